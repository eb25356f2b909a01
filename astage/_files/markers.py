"""Commit markers: a step is committed for a rank exactly when its marker exists.

A marker is JSON naming the rank's checkpoint file with its size and a checksum of its
storage table, and carrying a crc32c of its own fields.  It is written last (temp file,
fsync, rename, directory fsync), after every file it names is durable.  Read back, it is
untrusted input like any file: checksummed, naming only this rank's data file, and read
only if it is a regular file of bounded size.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import crc32c
import numpy as np

from .._format.codec import Encoded, FileHeader
from .._util.errors import IntegrityError
from .._util.limits import INT64, RANK_LIMIT
from .directory import rank_file_names
from .reading import inspect_checkpoint_file, load_checkpoint_file_sync, open_regular

MARKER_FORMAT: Final = "astage-checkpoint"
"""The ``format`` field of every commit marker."""

MARKER_VERSION: Final = 2
"""The only commit-marker version this module reads and writes (2 added the ``crc32c`` field)."""

_MARKER_CAP: Final = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class FileEntry:
    name: str
    nbytes: int
    storages_crc32c: int


@dataclasses.dataclass(frozen=True, slots=True)
class Marker:
    step: int
    rank: int
    checkpoint_id: str
    created: float
    files: tuple[FileEntry, ...]

    def to_json(self) -> bytes:
        body = {
            "format": MARKER_FORMAT,
            "version": MARKER_VERSION,
            "step": self.step,
            "rank": self.rank,
            "checkpoint_id": self.checkpoint_id,
            "created": self.created,
            "files": [dataclasses.asdict(f) for f in self.files],
        }
        doc = {**body, "crc32c": marker_crc32c(body)}
        return json.dumps(doc, indent=1, allow_nan=False).encode("ascii")


def marker_crc32c(body: dict[str, Any]) -> int:
    """The checksum a marker carries: crc32c of its other fields as canonical JSON."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return int(crc32c.crc32c(canonical.encode("ascii")))


_TABLE_ENTRY: Final = np.dtype([("offset", "<u8"), ("nbytes", "<u8"), ("crc32c", "<u4")])
"""One storage's entry in :func:`storages_crc32c`: ``struct`` ``"<QQI"``, 20 bytes, packed."""


def storages_crc32c(header: FileHeader) -> int:
    """A checksum of a replica's storage table (offsets, lengths and their crc32c)."""
    segments = header.segments
    return _table_crc32c(header.body_nbytes, segments.offsets, segments.nbytes, segments.crcs)


def encoded_storages_crc32c(encoded: Encoded) -> int:
    """:func:`storages_crc32c` of ``encoded``'s header, from the columns it was encoded
    from: no parse of the header (the parse and a record a storage held the event loop
    for tens of milliseconds in a save's background)."""
    layout = encoded.layout
    if layout is None or len(encoded.crcs) != len(layout.storage_table):
        return storages_crc32c(encoded.header)
    table = layout.storage_table
    return _table_crc32c(encoded.body_nbytes, table["offset"], table["nbytes"], np.asarray(encoded.crcs))


def _table_crc32c(body_nbytes: int, offsets: Any, nbytes: Any, crcs: Any) -> int:
    table = np.empty(len(offsets), _TABLE_ENTRY)
    table["offset"], table["nbytes"], table["crc32c"] = offsets, nbytes, crcs
    return int(crc32c.crc32c(struct.pack("<Q", body_nbytes) + table.tobytes()))


def json_document(data: bytes, what: str, fmt: str, version: int, keys: frozenset[str]) -> dict[str, Any]:
    """An untrusted JSON document (a commit marker, a commit object on the store): parsed,
    of format ``fmt`` and ``version``, with exactly the fields ``keys``.

    :raises IntegrityError: anything else.
    """
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"{what} is not valid JSON: {exc}") from exc
    if type(doc) is not dict or doc.get("format") != fmt or doc.get("version") != version:
        raise IntegrityError(f"{what}: not a version-{version} {fmt} document")
    if set(doc) != keys:
        raise IntegrityError(f"{what}: expected the fields {sorted(keys)}, got {sorted(doc)!r:.200}")
    return doc


def expect_int(doc: dict[str, Any], key: str, lo: int, hi: int, what: str = "commit marker") -> int:
    """``doc[key]``, an int in ``[lo, hi)`` of an untrusted JSON document (``what``)."""
    value = doc.get(key)
    if type(value) is not int or not lo <= value < hi:
        raise IntegrityError(f"{what} field {key!r}: expected an int in [{lo}, {hi}), got {value!r:.40}")
    return value


_MARKER_KEYS: Final = frozenset(
    {"format", "version", "step", "rank", "checkpoint_id", "created", "files", "crc32c"}
)
_CHECKPOINT_ID_RE: Final = re.compile(r"\A[0-9a-f]{32}\Z")


def parse_marker(data: bytes, *, step: int, rank: int) -> Marker:
    """Validate a commit marker strictly: it is untrusted input, like any file read back.

    Its checksum must match, and it may name only what astage writes there: this rank's
    data file of this step, once.

    :raises IntegrityError: malformed, tampered, of another format, step or rank, or
        naming any other file.
    """
    doc = json_document(data, "commit marker", MARKER_FORMAT, MARKER_VERSION, _MARKER_KEYS)
    body = {key: value for key, value in doc.items() if key != "crc32c"}
    try:
        expected = marker_crc32c(body)
    except (ValueError, RecursionError) as exc:  # a non-finite float, absurd nesting
        raise IntegrityError(f"commit marker: {exc}") from exc
    if type(doc["crc32c"]) is not int or doc["crc32c"] != expected:
        raise IntegrityError(
            f"commit marker checksum mismatch: it says {doc['crc32c']!r:.40}, the content gives {expected}"
        )
    if expect_int(doc, "step", 0, INT64) != step or expect_int(doc, "rank", 0, RANK_LIMIT) != rank:
        raise IntegrityError(
            f"commit marker is for step {doc['step']} rank {doc['rank']}, not step {step} rank {rank}"
        )
    checkpoint_id, created, files = doc["checkpoint_id"], doc["created"], doc["files"]
    if type(checkpoint_id) is not str or _CHECKPOINT_ID_RE.match(checkpoint_id) is None:
        raise IntegrityError(f"commit marker: bad checkpoint_id {checkpoint_id!r:.80}")
    if type(created) is not float or not math.isfinite(created):
        raise IntegrityError(f"commit marker: bad created {created!r:.40}")
    data_name = rank_file_names(rank)[0]
    if type(files) is not list or len(files) != 1:
        raise IntegrityError(f"commit marker: files must list exactly {data_name!r}, got {files!r:.120}")
    raw = files[0]
    if type(raw) is not dict or set(raw) != {"name", "nbytes", "storages_crc32c"}:
        raise IntegrityError(f"commit marker: bad file entry {raw!r:.120}")
    if raw["name"] != data_name:
        raise IntegrityError(f"commit marker: names the file {raw['name']!r:.80}, not {data_name!r}")
    entry = FileEntry(
        data_name, expect_int(raw, "nbytes", 0, INT64), expect_int(raw, "storages_crc32c", 0, 1 << 32)
    )
    return Marker(step, rank, checkpoint_id, created, (entry,))


def read_marker(path: str | os.PathLike[str], *, step: int, rank: int, dir_fd: int | None = None) -> Marker:
    """Read and validate the commit marker at ``path`` (blocking).

    Only a regular file is read (never a FIFO, device or symlink: :func:`open_regular`),
    and at most ``_MARKER_CAP`` bytes of it.

    :param dir_fd: open ``path`` relative to this directory descriptor.
    :raises FileNotFoundError: there is no marker: the step is not committed for ``rank``.
    :raises IntegrityError: it is not a regular file, is too long or is invalid.
    :raises OSError: it cannot be read.
    """
    fd = open_regular(path, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(_MARKER_CAP + 1)
    finally:
        os.close(fd)
    if len(data) > _MARKER_CAP:
        raise IntegrityError(f"commit marker {path} is over the {_MARKER_CAP}-byte cap")
    return parse_marker(data, step=step, rank=rank)


def header_check(
    path: Path, *, step: int, rank: int, checkpoint_id: str | None, entry: FileEntry | None
) -> Callable[[FileHeader], None]:
    """A check that a checkpoint file's header is ``rank``'s ``step`` (and, given, the
    marker's checkpoint and file entry), run before its body is read."""

    def check(header: FileHeader) -> None:
        if header.step != step or header.owner_rank != rank:
            raise IntegrityError(
                f"{path} holds step {header.step} of rank {header.owner_rank}, not step {step} of rank {rank}"
            )
        if checkpoint_id is not None and header.checkpoint_id != checkpoint_id:
            raise IntegrityError(
                f"{path} is checkpoint {header.checkpoint_id!r}, the commit marker names {checkpoint_id!r}"
            )
        if entry is not None and (
            header.total_nbytes != entry.nbytes or storages_crc32c(header) != entry.storages_crc32c
        ):
            raise IntegrityError(f"{path} does not match its commit marker (size or checksums)")

    return check


def check_committed(
    step_dir: Path, marker: Marker, *, verify: bool, on_read: Callable[[int], None] | None = None
) -> None:
    """Check that every file a commit marker names is there and matches it (blocking).

    Without ``verify`` only each file's header is read and compared with the marker (size,
    storage checksums); with it every byte is read and every checksum verified, as
    :meth:`astage.Checkpointer.restore` would.

    :param on_read: passed to :func:`~astage._files.reading.load_checkpoint_file_sync` (progress).
    :raises IntegrityError: a file does not match its marker or is corrupt.
    :raises OSError: a file is missing or cannot be read.
    """
    for entry in marker.files:
        path = step_dir / entry.name
        check = header_check(
            path, step=marker.step, rank=marker.rank, checkpoint_id=marker.checkpoint_id, entry=entry
        )
        check(inspect_checkpoint_file(path).header)
        if verify:
            load_checkpoint_file_sync(path, on_read=on_read)
