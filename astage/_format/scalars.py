"""The scalar table: a header's plain values apart from its structure.

Every leaf of a staged tree that is not a tensor (a learning rate, a step count, a tag, a
``torch.Size``, a numpy scalar: :func:`scalar_json` lists them) is written once, in the
order a walk of the tree meets it (a dict's values, then its attributes; a sequence's
items), into the header's scalar table; the tree refers to entry ``k`` by the int ``k``,
and the ``k``-th leaf met is entry ``k``.  That index is the one name of a scalar: the
stager's patch slots (:class:`astage._staging.recheck.AtomSlots`) number their scalars by
the same walk (:func:`astage._staging.recheck.scalar_trails_in_slices`, which gives each its
place), the layout cache replaces an entry by it, and the holder's header cache puts a
changed entry into a kept plan at that walk's trail (:func:`with_scalars`).

Values keep their exact type and value: ints of any size up to :data:`INT_BITS_CAP` bits,
``-0.0``, non-finite floats (tagged), strs with any character (``\\u``-escaped), numpy
scalars bit for bit.  Pure: no file, socket or thread.
"""

from __future__ import annotations

import binascii
import collections
import dataclasses
import itertools
import json
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import numpy as np
import torch

from .._staging.plan import AtomNode, DictNode, Node, SeqNode
from .._staging.recheck import Trail, plan_children
from .._util.limits import INT64 as _INT64
from .spec import DTYPES, MAX_NDIM, NUMPY_DTYPES, header_error

INT_BITS_CAP: Final = 13_000
"""Largest int a header holds, in bits: below CPython's 4300-digit int/str conversion limit."""

PLAIN: Final = (type(None), bool, int, float, str)
"""The types whose JSON form is (but for non-finite floats) the value itself."""

_PLAIN_TYPES: Final = frozenset(PLAIN)

TAGS: Final = frozenset({"bytes", "complex", "size", "dtype", "device", "numpy"})
"""The tags of the scalar entries that are not plain JSON values."""

_TORCH_DTYPE_LEAVES: Final[Mapping[str, torch.dtype]] = {
    **DTYPES,
    **{
        name: getattr(torch, name)
        for name in (
            *("complex32", "qint8", "quint8", "qint32", "quint4x2", "quint2x4"),
            *("bits1x8", "bits2x4", "bits4x2", "bits8", "bits16"),
            *(f"int{n}" for n in range(1, 8)),
            *(f"uint{n}" for n in range(1, 8)),
        )
        if isinstance(getattr(torch, name, None), torch.dtype)
    },
}
"""Every torch dtype a ``torch.dtype`` scalar may name: tensors need the allow-list, a dtype
object is only a name."""

_TORCH_DTYPE_LEAF_NAMES: Final = {dtype: name for name, dtype in _TORCH_DTYPE_LEAVES.items()}
NUMPY_NAMES: Final = {(dt.kind, dt.itemsize): name for name, dt in NUMPY_DTYPES.items()}
"""numpy ``(kind, itemsize)`` to the name a file gives arrays and scalars of that dtype."""
_DEVICE_TYPE_CHARS: Final = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")
NONFINITE: Final = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


# -- writing ------------------------------------------------------------------------------


def json_text(value: Any) -> str:
    """``value`` as the header writes JSON: compact, ASCII, no NaN constants."""
    return json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))


def key_json(value: Any) -> Any:
    """The JSON form of a plain scalar (a dict key), or raise TypeError/ValueError."""
    cls = type(value)
    if cls is float and not math.isfinite(value):
        return ["float", "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")]
    if cls is int and value.bit_length() > INT_BITS_CAP:
        raise ValueError(f"int of {value.bit_length()} bits is too large for a checkpoint file header")
    if cls not in PLAIN:
        raise TypeError(f"{cls.__qualname__} is not JSON-representable")
    return value


def scalar_json(value: Any) -> Any:
    """The scalar table entry of a leaf value, or raise TypeError/ValueError.

    Exact: numpy scalars are stored as their bits, so NaN payloads and -0.0 survive too.
    """
    cls = type(value)
    if cls in PLAIN:
        return key_json(value)
    if cls is bytes:
        return ["bytes", binascii.b2a_base64(value, newline=False).decode("ascii")]
    if cls is complex:
        return ["complex", key_json(value.real), key_json(value.imag)]
    if cls is torch.Size:
        if len(value) > MAX_NDIM or not all(-_INT64 <= n < _INT64 for n in value):
            raise ValueError(f"a torch.Size must hold at most {MAX_NDIM} 64-bit ints")
        return ["size", list(value)]
    if cls is torch.dtype:
        name = _TORCH_DTYPE_LEAF_NAMES.get(value)
        if name is None:
            raise ValueError(f"{value} is not a dtype a checkpoint file can name")
        return ["dtype", name]
    if cls is torch.device:
        return ["device", value.type, value.index]
    if isinstance(value, np.generic):
        return _numpy_json(value)
    raise TypeError(f"{cls.__qualname__} is not a value a checkpoint file holds")


def _numpy_json(value: np.generic) -> list[Any]:
    name = NUMPY_NAMES.get((value.dtype.kind, value.dtype.itemsize))
    if name is None or value.dtype.fields is not None:
        raise TypeError(f"numpy {value.dtype} scalars are not stored (only {', '.join(NUMPY_DTYPES)})")
    little = NUMPY_DTYPES[name].newbyteorder("<")
    return ["numpy", name, int.from_bytes(np.asarray(value, dtype=little).tobytes(), "little")]


def scalar_text(value: Any) -> str:
    """A leaf's entry in the scalar table as text, or raise TypeError/ValueError."""
    return json_text(scalar_json(value))


# -- reading ------------------------------------------------------------------------------


def _float_part(raw: Any) -> float | None:
    if type(raw) is float:
        return raw
    if type(raw) is list and len(raw) == 2 and raw[0] == "float" and raw[1] in NONFINITE:
        return NONFINITE[raw[1]]
    return None


def _bytes_leaf(text: Any) -> bytes | None:
    if type(text) is not str:
        return None
    return binascii.a2b_base64(text.encode("ascii"), strict_mode=True)


def _complex_leaf(real: Any, imag: Any) -> complex | None:
    re, im = _float_part(real), _float_part(imag)
    return None if re is None or im is None else complex(re, im)


def _size_leaf(dims: Any) -> torch.Size | None:
    if type(dims) is not list or len(dims) > MAX_NDIM:
        return None
    if not all(type(n) is int and -_INT64 <= n < _INT64 for n in dims):
        return None
    return torch.Size(dims)


def _dtype_leaf(name: Any) -> torch.dtype | None:
    return _TORCH_DTYPE_LEAVES.get(name) if type(name) is str else None


def _device_leaf(kind: Any, index: Any) -> torch.device | None:
    if type(kind) is not str or not 0 < len(kind) <= 32 or not _DEVICE_TYPE_CHARS.issuperset(kind):
        return None
    if index is None:
        return torch.device(kind)
    if type(index) is not int or not 0 <= index < 1 << 15:
        return None
    return torch.device(kind, index)  # RuntimeError for a type torch does not know


def _numpy_leaf(name: Any, bits: Any) -> np.generic | None:
    dtype = NUMPY_DTYPES.get(name) if type(name) is str else None
    if dtype is None or type(bits) is not int or not 0 <= bits < 1 << (8 * dtype.itemsize):
        return None
    if dtype.kind == "b" and bits > 1:
        return None
    value: np.generic = np.frombuffer(bits.to_bytes(dtype.itemsize, "little"), dtype.newbyteorder("<"))[0]
    return value


_LEAF_DECODERS: Final[Mapping[str, Callable[..., Any]]] = {
    "bytes": _bytes_leaf,
    "complex": _complex_leaf,
    "size": _size_leaf,
    "dtype": _dtype_leaf,
    "device": _device_leaf,
    "numpy": _numpy_leaf,
}
"""Tags to their decoders: each returns the value, or ``None`` if malformed."""


def key_value(raw: Any, where: str) -> Any:
    """The value of a plain scalar's JSON form (a dict key).

    :raises IntegrityError: anything else.
    """
    if type(raw) in PLAIN:
        return raw
    if type(raw) is list and len(raw) == 2 and raw[0] == "float" and raw[1] in NONFINITE:
        return NONFINITE[raw[1]]
    raise header_error(where, f"expected a JSON scalar, got {raw!r:.80}")


def scalar_value(raw: Any, where: str) -> Any:
    """The value of a scalar table entry, checked.

    :raises IntegrityError: not an entry :func:`scalar_json` writes.
    """
    if type(raw) is not list or not raw or raw[0] == "float":
        return key_value(raw, where)
    tag = raw[0]
    if type(tag) is not str or tag not in TAGS:
        raise header_error(where, f"unknown scalar {raw!r:.80}")
    try:
        value = _LEAF_DECODERS[tag](*raw[1:])
    except (TypeError, ValueError, OverflowError, RuntimeError, binascii.Error) as exc:
        raise header_error(where, f"malformed {tag} scalar {raw!r:.80}: {exc}") from exc
    if value is None:
        raise header_error(where, f"malformed {tag} scalar {raw!r:.80}")
    return value


def scalar_values(raw: Any) -> list[Any]:
    """The values of a header's scalar table (a JSON list), each checked.

    :raises IntegrityError: not a list, or an entry :func:`scalar_value` refuses.
    """
    if type(raw) is not list:
        raise header_error("scalars", f"expected a list, got {raw!r:.80}")
    if set(map(type, raw)) <= _PLAIN_TYPES:  # the common case: no tagged entry
        return raw
    return [scalar_value(item, f"scalars[{k}]") for k, item in enumerate(raw)]


def same_scalar(old: Any, new: Any) -> bool:
    """Whether two table values are the same, type and bits (``-0.0`` is not ``0.0``, NaN is NaN)."""
    cls = type(old)
    if type(new) is not cls:
        return False
    if cls is float:
        return repr(old) == repr(new)
    if cls in PLAIN:
        return bool(old == new)
    return scalar_text(old) == scalar_text(new)


_EXACT: Final = frozenset({type(None), bool, int, str})
"""Value types whose ``==`` with the same type means the same value (no ``-0.0``, no NaN)."""


def changed_scalars(old: Sequence[Any], new: Sequence[Any]) -> list[int]:
    """The indices where two scalar tables of one length differ (:func:`same_scalar`).

    At C speed where the tables are equal by ``==`` with the same types (the common case: a
    step count, or nothing, changed), only the entries of types ``==`` is not exact for
    (floats, tagged values) are compared one by one.
    """
    types = list(map(type, new))
    if types == list(map(type, old)) and list(old) == list(new):
        suspects: Iterable[int] = itertools.compress(
            range(len(types)), map(operator.not_, map(_EXACT.__contains__, types))
        )
    else:
        suspects = range(len(new))
    return [i for i in suspects if not same_scalar(old[i], new[i])]


# -- putting changed scalars into a plan ---------------------------------------------------
# (Each scalar's place is its trail: astage._staging.recheck.scalar_trails_in_slices, the walk
# that numbers them.)


def with_scalars(root: Node, changed: Sequence[tuple[Trail, Any]]) -> Node:
    """``root`` with the scalars at ``changed`` (trails, values) replaced, and the containers
    on their way rebuilt (everything else shared)."""
    if len(changed) == 1 and not changed[0][0]:  # the root itself is the scalar
        return AtomNode(changed[0][1])
    if isinstance(root, DictNode):
        new = _replaced(plan_children(root), changed)
        count = len(root.values)
        attrs = tuple((name, value) for (name, _), value in zip(root.attrs, new[count:], strict=True))
        return dataclasses.replace(root, values=new[:count], attrs=attrs)
    assert isinstance(root, SeqNode)
    return dataclasses.replace(root, items=_replaced(root.items, changed))


def _replaced(nodes: tuple[Node, ...], changed: Sequence[tuple[Trail, Any]]) -> tuple[Node, ...]:
    below: dict[int, list[tuple[Trail, Any]]] = collections.defaultdict(list)
    for trail, value in changed:
        below[trail[0]].append((trail[1:], value))
    out = list(nodes)
    for i, under in below.items():
        out[i] = with_scalars(out[i], under)
    return tuple(out)
