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
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Final

from ._errors import IntegrityError
from ._format import CheckedPrefix, FileHeader, Segments, check_prefix, parse_checked
from ._gc import without_gc
from ._header_tree import _meta, _reject_constant, _unique_keys

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


class HeaderCache:
    """Parses headers as :func:`~astage._format.parse_prefix` does, re-using the last
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
            self._kept = _Kept(header, prefix.version, tables, text, charged)
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
    cut = len(text) - len(tail) - 1
    if (
        prefix.version != kept.version
        or prefix.budget < kept.charged  # a full parse would run out: let it say so
        or cut < 1
        or text[cut] != ","
        or not text.endswith(tail)
        or _tables(prefix) != kept.tables
    ):
        return None
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
        plan=old.plan,
        dtensors=old.dtensors,
        version=prefix.version,
    )
