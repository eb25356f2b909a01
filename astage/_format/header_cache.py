"""Parsing a peer's replica headers once per structure, not once per replica.

A rank that holds a peer's replicas receives a header of the same structure every save:
only the metadata (step, checkpoint id, time) and the storages' checksums change.  A full
parse of 20,000 tensors builds the plan (a record a tensor, ~12 ms); :class:`HeaderCache`
keeps the last plan and re-uses it when nothing but those fields differ.

"Nothing else differs" is checked exactly, never assumed: every byte of the tensor and
dims tables, every storage record but its checksum, and the whole tree text (the JSON after
the metadata members) must equal the kept header's, and the metadata is parsed and checked
as a full parse checks it.  The prefix itself (its length, checksum, padding and parse
bound) is checked first, as always.  A header that differs anywhere, or that a full parse
might refuse, is parsed in full, so an error is raised exactly where ``parse_prefix``
raises it, with its message.

Scalars are data, not structure: a training loop's step count or learning rate changes
every save.  The kept tree text is cut once around each scalar that sits in a dict (its
values or attributes) or a sequence (:class:`_TailCut`, by :func:`astage._format.tree.iter_cut`,
as the writer's layout cache cuts its own); a later text whose every other byte equals the
kept pieces, and whose values between them each parse as a scalar the full parse accepts
there, gets the kept plan with those scalars replaced (the containers above them rebuilt,
nothing else).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
from typing import Any, Final

from .._staging.plan import AtomNode, DictNode, Node, SeqNode, StagePlan
from .._util.collector import without_gc
from .._util.errors import IntegrityError
from .._util.timeslice import drive
from .codec import CheckedPrefix, FileHeader, Segments, check_prefix, parse_checked
from .tree import (
    _V2_LEAVES,
    _HeaderParser,
    _meta,
    _reject_constant,
    _unique_keys,
    iter_cut,
)

log = logging.getLogger("astage.format")

_TREE_MEMBERS: Final = ',"dtensors":'
"""Where the encoder's tree members begin, after the metadata (a version-3 document).  The
first such text is outside every string (a quote inside a string is escaped)."""

_META_KEYS: Final = frozenset(
    {"format", "owner_rank", "holder_rank", "step", "checkpoint_id", "created", "body_nbytes"}
)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Kept:
    """A parsed header, with what a later one must equal to share its plan."""

    header: FileHeader
    version: int
    tables: bytes
    """The tensor and dims tables, and the storage table with its checksums zeroed."""
    tail: str
    """The JSON after the metadata members and their comma: the tree members and the ``}``."""
    charged: int
    """What the structure charged against the parse bound."""
    cut: _TailCut | None = None
    """``tail`` cut around its scalars, if it has any and the cut gives it back exactly."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _TailCut:
    """A kept tree text cut around its scalars: ``pieces[0] + texts[0] + pieces[1] + ... +
    pieces[-1]`` is the tail, and ``trails[k]`` the child indices from the plan's root down
    to the scalar whose text is ``texts[k]``."""

    pieces: tuple[str, ...]
    texts: tuple[str, ...]
    trails: tuple[tuple[int, ...], ...]


_DECODER: Final = json.JSONDecoder(parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
"""One JSON value as the full parse reads the document (no NaN constants, no repeated keys)."""


class HeaderCache:
    """Parses headers as :func:`~astage._format.codec.parse_prefix` does, re-using the last
    header's plan for one that differs only in its metadata and checksums.

    Holds the last header and its tree text (at most its header's length).  Not
    thread-safe: one parse at a time.
    """

    def __init__(self) -> None:
        self._kept: _Kept | None = None
        self.reused = 0
        """How many parses re-used a kept plan."""

    @without_gc
    def parse(self, data: bytes | bytearray | memoryview) -> FileHeader:
        """The header of the prefix in ``data``.

        :raises IntegrityError: as ``parse_prefix``.
        """
        prefix = check_prefix(data)
        kept = self._kept
        if kept is not None:
            header = _reuse(kept, prefix)
            if header is not None:
                self.reused += 1
                return header
        self._kept = None
        tail = _tail_at(prefix)  # read before the parse, which takes the text
        tables = _tables(prefix)
        header, charged = parse_checked(prefix)
        if tail is not None and tables is not None:
            # The tail is copied out of the prefix only now: the parse bound counts the
            # text once, so it must not be held twice through the parse.
            text = str(memoryview(data).cast("B")[tail], "ascii")
            self._kept = _Kept(header, prefix.version, tables, text, charged, _cut(header, text))
        return header


def _tables(prefix: CheckedPrefix) -> bytes | None:
    tables = prefix.tables
    if tables is None:
        return None
    storages = tables.storages.copy()
    storages["crc32c"] = 0
    return b"".join([tables.tensors.tobytes(), tables.dims.tobytes(), storages.tobytes()])


def _tail_at(prefix: CheckedPrefix) -> slice | None:
    """Where in the prefix the text after the metadata members and their comma lies, or
    ``None`` if the header was not written as astage's encoder writes (then every header
    is parsed in full)."""
    text = prefix.text
    cut = text.find(_TREE_MEMBERS)
    if cut < 0:
        return None
    try:
        meta = json.loads(text[:cut] + "}")
    except ValueError:
        return None
    if type(meta) is not dict or meta.keys() != _META_KEYS:
        return None
    return slice(prefix.text_at + cut + 1, prefix.text_at + len(text))


def _reuse(kept: _Kept, prefix: CheckedPrefix) -> FileHeader | None:
    """``prefix``'s header made from ``kept``'s plan, or ``None`` if a full parse is needed."""
    text, tail = prefix.text, kept.tail
    if (
        prefix.version != kept.version
        or prefix.budget < kept.charged  # a full parse would run out: let it say so
        or _tables(prefix) != kept.tables
    ):
        return None
    plan = kept.header.plan
    cut = len(text) - len(tail) - 1
    if cut < 1 or text[cut] != "," or not text.endswith(tail):
        cut = text.find(_TREE_MEMBERS)  # outside every string, if the metadata is well formed
        patched = None if kept.cut is None or cut < 1 else _patched(kept, kept.cut, text, cut + 1)
        if patched is None:
            return None
        plan = patched
    try:
        doc = json.loads(text[:cut] + "}", parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
        if type(doc) is not dict or doc.keys() != _META_KEYS:
            return None
        if doc["format"] != prefix.version or type(doc["format"]) is not int:
            return None
        meta = _meta(doc)
    except (ValueError, RecursionError, IntegrityError):
        return None  # the full parse raises its own error
    old = kept.header
    if meta["body_nbytes"] != old.body_nbytes:
        return None
    assert prefix.tables is not None
    records = prefix.tables.storages
    segments = Segments(records["offset"], records["nbytes"], records["crc32c"])
    log.debug("header of step %d parsed with the kept plan of step %d", meta["step"], old.step)
    return FileHeader(
        **meta,
        prefix_nbytes=prefix.total,
        segments=segments,
        plan=plan,
        dtensors=old.dtensors,
        version=prefix.version,
    )


def _children(node: Node) -> tuple[Node, ...]:
    """A container's children in text order: a dict's values, then its attributes'."""
    if type(node) is DictNode:
        return node.values + tuple(value for _, value in node.attrs)
    if type(node) is SeqNode:
        return node.items
    return ()


def _slots(node: Node, trail: tuple[int, ...], out: list[tuple[AtomNode, tuple[int, ...]]]) -> None:
    """Every scalar held by a dict (values and attributes) or a sequence under ``node``, in
    text order, with its trail of child indices (:func:`_children`)."""
    children = _children(node)
    for i, child in enumerate(children):
        if type(child) is AtomNode:
            out.append((child, (*trail, i)))
        elif type(child) is DictNode or type(child) is SeqNode:
            _slots(child, (*trail, i), out)


def _cut(header: FileHeader, tail: str) -> _TailCut | None:
    """``tail`` (header's tree text) cut around its scalars, or ``None`` where it has none,
    holds DTensor notes, or is not exactly what astage's encoder writes for the plan.

    Once per structure, in the parsing worker thread: a walk of the plan (~1 us a tensor).
    """
    if any(note is not None for note in header.dtensors) or not tail.endswith("}"):
        return None
    found: list[tuple[AtomNode, tuple[int, ...]]] = []
    _slots(header.plan.root, (), found)
    if not found:
        return None
    try:
        cut = drive(iter_cut(header.plan, [node for node, _ in found], tail[:-1]))
    except (TypeError, ValueError, RecursionError) as exc:  # a plan the encoder refuses
        log.debug("no scalar cut of this header: %r", exc)
        return None
    if cut is None:
        return None
    pieces, order, texts = cut
    pieces[-1] += "}"
    return _TailCut(tuple(pieces), tuple(texts), tuple(found[k][1] for k in order))


def _patched(kept: _Kept, cut: _TailCut, text: str, at: int) -> StagePlan | None:
    """The kept plan with the scalars ``text`` holds from ``at`` on, if every other byte is
    the kept pieces' and each value there is a scalar the full parse would accept."""
    parser = _HeaderParser(0, kept.version, 0)  # for its scalar and leaf checks only
    changed: list[tuple[tuple[int, ...], Any]] = []
    pos = at
    for piece, old, trail in zip(cut.pieces, cut.texts, cut.trails, strict=False):
        if not text.startswith(piece, pos):
            return None
        pos += len(piece)
        try:
            raw, end = _DECODER.raw_decode(text, pos)
        except (ValueError, RecursionError):
            return None
        if text[pos:end] != old:
            value = _scalar(parser, raw)
            if value is _NOT_SCALAR:
                return None
            changed.append((trail, value))
        pos = end
    if len(text) - pos != len(cut.pieces[-1]) or not text.endswith(cut.pieces[-1]):
        return None
    plan = kept.header.plan
    if not changed:
        return plan
    return StagePlan(_rebuilt(plan.root, changed), plan.tensors, plan.storages)


_NOT_SCALAR: Final = object()


def _scalar(parser: _HeaderParser, raw: Any) -> Any:
    """The value the full parse reads from ``raw`` where a scalar was, or :data:`_NOT_SCALAR`."""
    try:
        if type(raw) is not list or not raw or raw[0] == "float":
            return parser.scalar(raw, ())
        if type(raw[0]) is str and raw[0] in _V2_LEAVES:
            return parser.leaf(raw, ())
    except IntegrityError:
        pass  # the full parse raises it, with its key path
    return _NOT_SCALAR


def _rebuilt(node: Node, changed: list[tuple[tuple[int, ...], Any]]) -> Node:
    """``node`` with the scalars at ``changed`` (child index trails, values) replaced, and
    the containers on their way rebuilt (everything else shared)."""
    if isinstance(node, DictNode):
        children = _replaced(_children(node), changed)
        count = len(node.values)
        attrs = tuple((name, value) for (name, _), value in zip(node.attrs, children[count:], strict=True))
        return dataclasses.replace(node, values=children[:count], attrs=attrs)
    assert isinstance(node, SeqNode)
    return dataclasses.replace(node, items=_replaced(node.items, changed))


def _replaced(children: tuple[Node, ...], changed: list[tuple[tuple[int, ...], Any]]) -> tuple[Node, ...]:
    below: dict[int, list[tuple[tuple[int, ...], Any]]] = collections.defaultdict(list)
    for trail, value in changed:
        below[trail[0]].append((trail[1:], value))
    out = list(children)
    for i, under in below.items():
        if len(under) == 1 and not under[0][0]:
            out[i] = AtomNode(under[0][1])
        else:
            out[i] = _rebuilt(out[i], under)
    return tuple(out)
