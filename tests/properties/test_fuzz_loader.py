"""Fuzzing the replica loaders with hostile bytes: an integrity error, or a valid state_dict.

Hypothesis builds valid replicas of varied small state_dicts and damages them: bit flips,
byte edits, truncation, appended, deleted, inserted and duplicated ranges (random bytes,
pieces of another replica, pickle payloads), edits of the header length field, and edits of
the header JSON that are re-checksummed (and of the body with its checksums recomputed), so
that the damage gets past the checksums to the deep validation.  Every result is handed to
every loader: :func:`astage.load_checkpoint_file_sync` and :func:`astage.find_replicas` on a file,
:func:`parse_prefix` plus :func:`decode` in memory (what a receiving rank does), and
``_read_replica_file`` (what ``recover()`` sends back).  Each must either return a valid
state_dict (all loaders agreeing) or raise :class:`astage.IntegrityError`; nothing else.

Two guards hold while a loader runs:

* **Allocation.**  The process's address space (``RLIMIT_AS``) is capped at its current size
  plus :data:`HEADER_CAP`.  Every allocation counts against it: Python objects, torch's and
  numpy's buffers, mmaps, even untouched pages, which an RSS or tracemalloc check would miss
  (``torch.empty`` of a terabyte costs no RSS, and tracemalloc does not see torch at all).
  A loader that trusted a length field would fail to allocate, which raises
  ``MemoryError``/``RuntimeError``: not an integrity error, so the property fails.  The fuzzed
  files are a few KiB, so a correct loader stays far below the cap; a test checks the guard
  does bite.
* **Execution.**  An audit hook (PEP 578) records every audited event a loader causes: a
  pickle ``find_class``, ``exec`` or ``compile`` of anything but the ``__new__`` that
  :func:`collections.namedtuple` compiles from validated identifiers, an ``open`` of anything
  but the replica (or for writing), ``os.system``, ``subprocess.Popen``, imports, and so on all
  fail the property.  The pickle payloads would also create a sentinel file if ever run.

``ASTAGE_FUZZ_EXAMPLES`` sets the examples per property (default 300, a few seconds); run
``ASTAGE_FUZZ_EXAMPLES=100000 pytest tests/properties/test_fuzz_loader.py`` for a long campaign.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import pickle
import re
import resource
import struct
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import numpy.ma  # numpy imports it lazily on a first use; the audit must not see that
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import astage
from astage._files.reading import find_replicas, load_checkpoint_file_sync
from astage._format.codec import (
    ALIGNMENT,
    FIXED_PREFIX_NBYTES,
    FORMAT_VERSION,
    HEADER_CAP,
    MAGIC,
    NUMPY_DTYPES,
    STORAGE_RECORD,
    TENSOR_RECORD,
    decode,
    encode,
    parse_prefix,
)
from astage._replication.replicas import read_replica_file as _read_replica_file
from tests.statedicts import ALL_DTYPES, random_tensor, tensors_of

EXAMPLES = int(os.environ.get("ASTAGE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
)

Pair = collections.namedtuple("Pair", ["first", "second"])


# -- payloads that must never run ------------------------------------------------------------

SENTINEL = Path(tempfile.gettempdir()) / f"astage-fuzz-executed-{os.getpid()}"
"""Created by the payloads below if anything ever unpickles them."""


class _Trap:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(SENTINEL),))


def _torch_saved() -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": _Trap()}, buffer)
    return buffer.getvalue()


PAYLOADS = [pickle.dumps(_Trap(), protocol=p) for p in (0, 2, 5)] + [_torch_saved()]
TEXT_PAYLOAD = PAYLOADS[0].decode("ascii")
"""Protocol 0 is ASCII: it fits in a JSON string of the header."""


# -- valid replicas of varied state_dicts ----------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
)
_keys = st.one_of(st.text(max_size=4), st.integers(-3, 3))


def _numpy_values(dtype: np.dtype[Any], raw: bytes) -> np.ndarray[Any, Any]:
    """``raw`` as values of ``dtype``, any bits (NaN payloads too), bools only 0 or 1."""
    raw = raw[: len(raw) // dtype.itemsize * dtype.itemsize]
    return np.frombuffer(bytes(b & 1 for b in raw) if dtype.kind == "b" else raw, dtype)


_NUMPY_DTYPES = [np.dtype(name) for name in NUMPY_DTYPES]
_format_2_leaves = st.one_of(
    st.binary(max_size=8),
    st.complex_numbers(),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3).map(torch.Size),
    st.sampled_from([torch.float32, torch.bfloat16, torch.complex32, torch.quint8, torch.int4]),
    st.sampled_from([torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")]),
    st.builds(
        lambda dtype, raw: _numpy_values(dtype, raw)[0],
        st.sampled_from(_NUMPY_DTYPES),
        st.binary(min_size=16, max_size=16),
    ),
)
_specs = st.recursive(
    st.one_of(
        _scalars.map(lambda v: ("scalar", v)),
        _format_2_leaves.map(lambda v: ("scalar", v)),
        st.tuples(
            st.just("ndarray"),
            st.sampled_from(_NUMPY_DTYPES),
            st.lists(st.integers(0, 3), max_size=3),
            st.sampled_from(["C", "F", "T"]),
        ),
        st.tuples(st.just("tensor"), st.sampled_from(ALL_DTYPES), st.lists(st.integers(0, 3), max_size=3)),
        st.tuples(st.just("view"), st.integers(0, 7), st.sampled_from(["same", "flat", "tail", "t"])),
        st.tuples(st.just("parameter"), st.integers(1, 4)),
    ),
    lambda inner: st.one_of(
        st.tuples(st.sampled_from(["dict", "odict"]), st.dictionaries(_keys, inner, max_size=3)),
        st.tuples(st.sampled_from(["list", "tuple"]), st.lists(inner, max_size=3)),
        st.tuples(st.just("pair"), inner, inner),
    ),
    max_leaves=8,
)


def _build(spec: Any, gen: torch.Generator, tensors: list[torch.Tensor]) -> Any:
    kind = spec[0]
    if kind == "scalar":
        return spec[1]
    if kind == "tensor":
        tensor = random_tensor(tuple(spec[2]), spec[1], gen)
        tensors.append(tensor)
        return tensor
    if kind == "parameter":
        return torch.nn.Parameter(torch.randn(spec[1], generator=gen))
    if kind == "ndarray":
        nbytes = math.prod(spec[2]) * spec[1].itemsize
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).numpy().tobytes()
        array = _numpy_values(spec[1], raw).reshape(spec[2])
        return np.asfortranarray(array) if spec[3] == "F" else array.T if spec[3] == "T" else array.copy()
    if kind == "view":
        if not tensors:
            return torch.zeros(2, dtype=torch.int16)
        base = tensors[spec[1] % len(tensors)]
        flat = base.reshape(-1) if base.is_contiguous() else base
        views = {"same": base, "flat": flat, "tail": flat[1:], "t": base.t() if base.dim() == 2 else base}
        return views[spec[2]]
    if kind in ("dict", "odict"):
        items = [(k, _build(v, gen, tensors)) for k, v in spec[1].items()]
        return dict(items) if kind == "dict" else collections.OrderedDict(items)
    if kind in ("list", "tuple"):
        items = [_build(v, gen, tensors) for v in spec[1]]
        return items if kind == "list" else tuple(items)
    return Pair(_build(spec[1], gen, tensors), _build(spec[2], gen, tensors))


@st.composite
def replicas(draw: st.DrawFn) -> bytes:
    """The bytes of a valid replica of a small, varied state_dict."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    state = {"root": _build(draw(_specs), gen, [])}
    encoded = encode(
        state,
        owner_rank=draw(st.integers(0, 2**31 - 1)),
        holder_rank=draw(st.none() | st.integers(0, 2**31 - 1)),
        step=draw(st.integers(-(2**63), 2**63 - 1)),
        checkpoint_id=draw(st.text(max_size=8)),
    )
    return b"".join(encoded.buffers())


# -- mutations --------------------------------------------------------------------------------

_HEADER = struct.Struct("<8sIQ")
_CRC = struct.Struct("<I")
COUNTS = struct.Struct("<QQQQ")


def _tables_len(header: bytes) -> int | None:
    """Length of the binary tables that open a header, if its counts fit."""
    if len(header) < COUNTS.size:
        return None
    tensors, dims, storages, _ = COUNTS.unpack_from(header)
    end = COUNTS.size + TENSOR_RECORD.itemsize * tensors + 8 * dims + STORAGE_RECORD.itemsize * storages
    return end if end <= len(header) else None


_STRUCTURE_KEYS = ("dtensors", "tree")


def _split(data: bytes) -> tuple[bytes, Any, bytes] | None:
    """The header's binary tables, its two JSON documents merged into one dict (the
    structure's members, then the values') and the body of ``data``, if its documents
    still parse as JSON objects."""
    if len(data) < FIXED_PREFIX_NBYTES:
        return None
    length = _HEADER.unpack_from(data)[2]
    end = FIXED_PREFIX_NBYTES + length
    if end + _CRC.size > len(data):
        return None
    header = data[FIXED_PREFIX_NBYTES:end]
    tables_len = _tables_len(header)
    if tables_len is None:
        return None
    split = tables_len + COUNTS.unpack_from(header)[3]
    try:
        structure, values = json.loads(header[tables_len:split]), json.loads(header[split:])
    except (ValueError, RecursionError):
        return None
    if type(structure) is not dict or type(values) is not dict:
        return None
    prefix = -(-(end + _CRC.size) // ALIGNMENT) * ALIGNMENT
    return header[:tables_len], {**structure, **values}, data[prefix:]


def forge(header: bytes, body: bytes, version: int = FORMAT_VERSION) -> bytes:
    """A prefix around ``header`` with a correct checksum and padding, then ``body``."""
    head = MAGIC + struct.pack("<IQ", version, len(header)) + header
    head += _CRC.pack(crc32c.crc32c(head))
    return head + bytes(-len(head) % ALIGNMENT) + body


def _join(tables: bytes, doc: Any) -> bytes:
    """A header of ``tables`` and ``doc`` (as :func:`_split` gives it) split back into its
    two documents, the tables' structure count set; a ``doc`` no longer a dict is all
    structure."""
    if type(doc) is dict:
        structure = {key: doc[key] for key in _STRUCTURE_KEYS if key in doc}
        values = {key: value for key, value in doc.items() if key not in _STRUCTURE_KEYS}
        texts = [json.dumps(part, separators=(",", ":")).encode() for part in (structure, values)]
    else:
        texts = [json.dumps(doc, separators=(",", ":")).encode(), b""]
    counts = COUNTS.unpack_from(tables)[:3] if len(tables) >= COUNTS.size else (0, 0, 0)
    return COUNTS.pack(*counts, len(texts[0])) + tables[COUNTS.size :] + b"".join(texts)


@dataclasses.dataclass(frozen=True)
class Flip:
    at: int
    bit: int

    def __call__(self, data: bytes) -> bytes:
        if not data:
            return data
        out = bytearray(data)
        out[self.at % len(out)] ^= 1 << self.bit
        return bytes(out)


@dataclasses.dataclass(frozen=True)
class SetByte:
    at: int
    value: int

    def __call__(self, data: bytes) -> bytes:
        if not data:
            return data
        out = bytearray(data)
        out[self.at % len(out)] = self.value
        return bytes(out)


@dataclasses.dataclass(frozen=True)
class Truncate:
    keep: int

    def __call__(self, data: bytes) -> bytes:
        return data[: self.keep % (len(data) + 1)]


@dataclasses.dataclass(frozen=True)
class Splice:
    """Delete ``drop`` bytes at ``at`` and insert ``insert`` there (``None``: a copy of them)."""

    at: int
    drop: int
    insert: bytes | None

    def __call__(self, data: bytes) -> bytes:
        at = self.at % (len(data) + 1)
        piece = data[at : at + self.drop] * 2 if self.insert is None else self.insert
        return data[:at] + piece + data[at + self.drop :]


@dataclasses.dataclass(frozen=True)
class SetHeaderLength:
    """Overwrite the header length field; ``rechecksum``: store a matching crc after it."""

    value: int
    rechecksum: bool

    def __call__(self, data: bytes) -> bytes:
        if len(data) < FIXED_PREFIX_NBYTES:
            return data
        out = bytearray(data)
        struct.pack_into("<Q", out, 12, self.value)
        end = FIXED_PREFIX_NBYTES + self.value
        if self.rechecksum and end + _CRC.size <= len(out):
            _CRC.pack_into(out, end, crc32c.crc32c(bytes(out[:end])))
        return bytes(out)


@dataclasses.dataclass(frozen=True)
class EditHeader:
    """Edit the header JSON at one position, then re-checksum it: reaches deep validation."""

    target: int
    action: str
    value: Any

    def __call__(self, data: bytes) -> bytes:
        split = _split(data)
        if split is None:
            return data
        tables, doc, body = split
        slots = list(_slots(doc))
        if not slots:
            return data
        parent, key = slots[self.target % len(slots)]
        if self.action == "replace":
            parent[key] = self.value
        elif self.action == "delete":
            del parent[key]
        elif self.action == "duplicate" and isinstance(parent, list):
            parent.insert(key, parent[key])
        elif isinstance(parent, list):
            parent.insert(key, self.value)
        else:
            parent[f"{key}_"] = self.value
        return forge(_join(tables, doc), body)


@dataclasses.dataclass(frozen=True)
class EditTable:
    """Write ``value`` over ``width`` bytes of a version-3 header's binary tables (counts,
    tensor records, dims, storage records), then re-checksum: reaches the table checks."""

    at: int
    width: int
    value: int

    def __call__(self, data: bytes) -> bytes:
        split = _split(data)
        if split is None or len(split[0]) < self.width:
            return data
        tables, doc, body = split
        at = self.at % (len(tables) - self.width + 1)
        piece = (self.value % (1 << (8 * self.width))).to_bytes(self.width, "little")
        return forge(_join(tables[:at] + piece + tables[at + self.width :], doc), body)


def _slots(node: Any) -> Iterator[tuple[Any, Any]]:
    """Every (container, key) position in a JSON document, depth first."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in list(items):
        yield node, key
        yield from _slots(child)


def _rechecksum(data: bytes) -> bytes:
    """Recompute the header's storage checksums and its own, if the header is still JSON."""
    split = _split(data)
    if split is None:
        return data
    tables, doc, body = split
    with contextlib.suppress(TypeError, ValueError, KeyError, IndexError):
        for entry in doc["storages"]:
            entry[2] = crc32c.crc32c(body[entry[0] : entry[0] + entry[1]])
    if tables:
        storages = np.frombuffer(
            tables, STORAGE_RECORD, offset=len(tables) - _storage_count(tables) * 24
        ).copy()
        for entry in storages:
            entry["crc32c"] = crc32c.crc32c(
                body[int(entry["offset"]) : int(entry["offset"] + entry["nbytes"])]
            )
        tables = tables[: len(tables) - storages.nbytes] + storages.tobytes()
    return forge(_join(tables, doc), body, _HEADER.unpack_from(data)[1])


def _storage_count(tables: bytes) -> int:
    return int(COUNTS.unpack_from(tables)[2])


@dataclasses.dataclass(frozen=True)
class Rechecksummed:
    """``mutation``, then every checksum made right again: the damage reaches the decoder."""

    mutation: Flip | Splice

    def __call__(self, data: bytes) -> bytes:
        return _rechecksum(self.mutation(data))


_positions = st.integers(0, 1 << 20)
_interesting_ints = st.sampled_from(
    [
        0,
        1,
        -1,
        63,
        64,
        65,
        2**31 - 1,
        2**31,
        2**32,
        2**53 + 1,
        2**62,
        2**63 - 1,
        2**63,
        2**64,
        -(2**63),
        HEADER_CAP,
    ]
)
_TAGS_AND_NAMES = [
    *("tensor", "ref", "dict", "odict", "list", "tuple", "namedtuple", "float", "nan", "parameter"),
    *("bytes", "complex", "size", "dtype", "device", "numpy", "ndarray", "cuda", "uint64", "complex32"),
    *("float32", "object", "torch.float32", "__reduce__", "os.system", "__import__('os')", TEXT_PAYLOAD),
]
_json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        _interesting_ints,
        st.integers(),
        st.floats(),
        st.text(max_size=12),
        st.sampled_from(_TAGS_AND_NAMES),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
_blobs = st.one_of(
    st.binary(max_size=64), st.sampled_from(PAYLOADS), st.binary(min_size=1, max_size=8).map(lambda b: b * 64)
)

BYTE_MUTATIONS = st.one_of(
    st.builds(Flip, _positions, st.integers(0, 7)),
    st.builds(SetByte, _positions, st.integers(0, 255)),
    st.builds(Truncate, _positions),
    st.builds(Splice, _positions, st.integers(0, 80), st.one_of(st.none(), _blobs)),
    st.builds(
        SetHeaderLength,
        st.one_of(_interesting_ints.filter(lambda n: 0 <= n < 2**64), st.integers(0, 2**64 - 1)),
        st.booleans(),
    ),
)
HEADER_MUTATIONS = st.one_of(
    st.builds(
        EditHeader, _positions, st.sampled_from(["replace", "delete", "insert", "duplicate"]), _json_values
    ),
    st.builds(EditTable, _positions, st.sampled_from([1, 4, 8]), _interesting_ints | st.integers()),
    st.builds(Rechecksummed, st.builds(Flip, _positions, st.integers(0, 7))),
    st.builds(Rechecksummed, st.builds(Splice, _positions, st.integers(0, 16), st.one_of(st.none(), _blobs))),
)


def _apply(data: bytes, mutations: list[Callable[[bytes], bytes]]) -> bytes:
    for mutation in mutations:
        data = mutation(data)
    return data


# -- the guards ---------------------------------------------------------------------------------

_NAMEDTUPLE_NEW = re.compile(
    r"lambda _cls, (?:\w+(?:, \w+)*,?)?: _tuple_new\(_cls, \((?:\w+(?:, \w+)*,?)?\)\)"
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Audit:
    """Records every audited event a loader causes that a loader has no business causing."""

    def __init__(self) -> None:
        self.thread: int | None = None
        self.readable: set[str] = set()
        self.violations: list[str] = []
        self.events: list[str] = []
        self.pending_compiles = 0

    def __call__(self, name: str, args: tuple[Any, ...]) -> None:
        # Loaders run in the thread that calls them: other threads' events are not theirs.
        if threading.get_ident() != self.thread:
            return
        self.events.append(name)
        if name == "open":
            path, _, flags = args
            allowed = str(path) in self.readable and not (isinstance(flags, int) and flags & _WRITE_FLAGS)
        elif name == "compile":
            source = args[0]
            allowed = isinstance(source, bytes) and _NAMEDTUPLE_NEW.fullmatch(source.decode()) is not None
            self.pending_compiles += allowed
        elif name == "exec":
            allowed = self.pending_compiles > 0  # a namedtuple __new__ compiled just before
            self.pending_compiles -= allowed
        elif name == "object.__setattr__":
            allowed = args[1] == "__module__"  # namedtuple places its class in a module
        else:
            # Introspection, not execution (tracers such as coverage or hypothesis's read
            # frame.f_code), and listing the directory in find_replicas.
            allowed = name in ("sys._getframe", "object.__getattr__", "os.scandir", "os.listdir")
        if not allowed:
            self.violations.append(f"{name}{repr(args)[:300]}")


_AUDIT = Audit()
sys.addaudithook(_AUDIT)


def _vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def guarded(readable: Path) -> Iterator[None]:
    """Cap the address space at its current size plus ``HEADER_CAP``; audit what runs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + HEADER_CAP
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    _AUDIT.readable = {str(readable)}
    _AUDIT.violations = []
    _AUDIT.events = []
    _AUDIT.pending_compiles = 0
    _AUDIT.thread = threading.get_ident()
    try:
        yield
    finally:
        _AUDIT.thread = None
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# -- the property ----------------------------------------------------------------------------------


def arrays_of(tree: Any) -> list[np.ndarray[Any, Any]]:
    """Every numpy array in a decoded tree (dicts, lists and tuples)."""
    if isinstance(tree, np.ndarray):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return [a for item in items for a in arrays_of(item)]


def _in_memory(data: bytes) -> Any:
    header = parse_prefix(data)
    body = torch.from_numpy(np.frombuffer(bytearray(data[header.prefix_nbytes :]), dtype=np.uint8))
    return decode(header, body)


def _prefix_fits(data: bytes) -> bool:
    """Whether the prefix is valid and the length right: all that find_replicas checks."""
    try:
        return parse_prefix(data).total_nbytes == len(data)
    except astage.IntegrityError:
        return False


def _or_integrity_error(load: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, load()
    except astage.IntegrityError as exc:
        return False, exc


def _touch_every_element(tensor: torch.Tensor) -> None:
    """Read every element of ``tensor``: all of them inside the body.

    A header may validly describe an expanded view (stride 0) of astronomically many
    elements over one: then its first and farthest elements are read instead, the ends of
    the memory it spans (cloning it would allocate terabytes).
    """
    if tensor.numel() * tensor.element_size() <= 1 << 26:
        tensor.clone()
    else:
        tensor[(0,) * tensor.dim()].item()
        tensor[tuple(n - 1 for n in tensor.shape)].item()


def check_loaders(data: bytes, path: Path) -> str:
    """Every loader returns a valid state_dict or raises IntegrityError; they agree on which.

    :returns: how the input was judged: ``valid``, or the start of the integrity error.
    """
    path.write_bytes(data)
    with guarded(path):
        from_file = _or_integrity_error(lambda: load_checkpoint_file_sync(path))
        from_memory = _or_integrity_error(lambda: _in_memory(data))
        held = _read_replica_file(path)
        listed = find_replicas(path.parent)
    assert _AUDIT.violations == [], f"a loader ran something; it caused {_AUDIT.events}"
    assert not SENTINEL.exists(), "a payload was executed"
    valid = from_file[0]
    assert from_memory[0] == valid, (from_file, from_memory)
    assert (held is not None) == valid
    assert [r.path for r in listed] == ([path] if _prefix_fits(data) else [])  # it reads prefixes only
    assert valid <= _prefix_fits(data)
    if not valid:
        return str(from_file[1]).removeprefix(f"{path}: ")[:24]
    for tensor in tensors_of(from_file[1]) + tensors_of(from_memory[1]):
        _touch_every_element(tensor.detach())
    for array in arrays_of(from_file[1]) + arrays_of(from_memory[1]):
        array.copy()
    return "valid"


@pytest.fixture
def replica_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> Path:
    caplog.set_level(logging.ERROR, logger="astage")  # find_replicas warns about each bad file
    return tmp_path / "fuzzed.astage"


@FUZZ
@given(original=replicas(), mutations=st.lists(BYTE_MUTATIONS, min_size=1, max_size=4))
def test_damaged_bytes_load_or_raise_integrity_error(
    original: bytes, mutations: list[Callable[[bytes], bytes]], replica_file: Path
) -> None:
    event(check_loaders(_apply(original, mutations), replica_file))


@FUZZ
@given(original=replicas(), mutations=st.lists(HEADER_MUTATIONS, min_size=1, max_size=3))
def test_rechecksummed_edits_load_or_raise_integrity_error(
    original: bytes, mutations: list[Callable[[bytes], bytes]], replica_file: Path
) -> None:
    event(check_loaders(_apply(original, mutations), replica_file))


@settings(FUZZ, max_examples=max(EXAMPLES // 3, 10))
@given(original=replicas())
def test_valid_replicas_load_everywhere(original: bytes, replica_file: Path) -> None:
    assert check_loaders(original, replica_file) == "valid"


# -- the guards bite, and the classic attacks -----------------------------------------------------


def test_the_allocation_guard_refuses_more_than_the_header_cap(tmp_path: Path) -> None:
    # Far beyond the cap: a smaller request might be served from heap space freed by an
    # earlier test, inside the address space the guard already counts.
    too_much = HEADER_CAP + (4 << 30)
    with guarded(tmp_path), pytest.raises(RuntimeError, match="allocate"):
        torch.empty(too_much, dtype=torch.uint8)
    with guarded(tmp_path), pytest.raises(MemoryError):
        bytearray(too_much)
    torch.empty(too_much, dtype=torch.uint8)  # and it is lifted afterwards (untouched pages)


def test_the_audit_guard_sees_unpickling_code_and_foreign_opens(tmp_path: Path) -> None:
    with guarded(tmp_path / "allowed"):
        collections.namedtuple("Fine", ["a"])
    assert _AUDIT.violations == []
    with guarded(tmp_path / "allowed"):
        pickle.loads(pickle.dumps(collections.OrderedDict()))
        eval("1 + 1")
        (tmp_path / "other").write_bytes(b"")
    assert [v.split("(")[0] for v in _AUDIT.violations] == ["pickle.find_class", "compile", "exec", "open"]


def _forged_replica(body_nbytes: int) -> bytes:
    """A replica of one tensor whose header claims a body (and storage) of ``body_nbytes``."""
    data = b"".join(encode({"w": torch.zeros(4)}, owner_rank=0, step=0, checkpoint_id="").buffers())
    split = _split(data)
    assert split is not None
    tables, doc, body = split
    doc["body_nbytes"] = body_nbytes
    storage = struct.pack("<QQII", 0, body_nbytes, 0, 0)
    return forge(_join(tables[: -len(storage)] + storage, doc), body)


@pytest.mark.parametrize(
    "data",
    [
        _forged_replica(1 << 40),
        _forged_replica((1 << 63) - 64),
        MAGIC + struct.pack("<IQ", 1, HEADER_CAP) + b"{}",
        MAGIC + struct.pack("<IQ", 1, 2**64 - 1),
        *PAYLOADS,
        forge(PAYLOADS[2], b""),
        forge(json.dumps({"tree": TEXT_PAYLOAD}).encode(), b""),
    ],
    ids=[
        *("1 TiB body", "2**63 body", "header at the cap", "header past 2**64"),
        *("pickle 0", "pickle 2", "pickle 5", "torch.save", "pickle header", "pickle in JSON"),
    ],
)
def test_classic_attacks_are_refused_without_allocating_or_running_anything(
    data: bytes, replica_file: Path
) -> None:
    assert check_loaders(data, replica_file) != "valid"


def test_a_rechecksummed_header_edit_reaches_the_deep_checks(replica_file: Path) -> None:
    original = b"".join(encode({"w": torch.zeros(4)}, owner_rank=0, step=0, checkpoint_id="").buffers())
    split = _split(original)
    assert split is not None
    slots = list(_slots(split[1]))
    target = next(i for i, (parent, key) in enumerate(slots) if key == "body_nbytes")
    edited = EditHeader(target, "replace", 2**62)(original)
    assert check_loaders(edited, replica_file).startswith("header body_nbytes")
