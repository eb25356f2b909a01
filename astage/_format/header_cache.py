"""Parsing a peer's replica headers once per structure, not once per replica.

A rank that holds a peer's replicas receives a header of the same structure every save:
only the metadata (step, checkpoint id, time), the storages' checksums and some scalars (a
step count, a learning rate) change.  A full parse builds the plan, a
record a tensor (~0.6 us each); :class:`HeaderCache` keeps the last plan and re-uses it for a
header of the same structure.

A header's structure is exactly its *structure bytes*
(:meth:`~astage._format.reader.CheckedPrefix.structure_key`): the table counts, the tensor
and dims tables, the storage table without its checksums, and the structure document (the tree and its
DTensor notes).  Its values (the metadata and the scalar table) are parsed and checked
every time, as a full parse checks them; scalars that changed are put into the kept plan
at their places (:func:`astage._staging.recheck.scalar_trails_in_slices`), the containers above them
rebuilt.  The prefix itself (its length, checksum, padding and parse bound) is checked
first, as always.  A header whose structure differs, or that a full parse might refuse, is
parsed in full, so an error is raised exactly where ``parse_prefix`` raises it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from .._staging.plan import StagePlan
from .._staging.recheck import Trail, plan_children, scalar_trails_in_slices
from .._util.collector import without_gc
from .._util.errors import IntegrityError
from .._util.timeslice import drive
from .header_parser import parse_values
from .reader import CheckedPrefix, StructureKey, check_prefix, load_document, parse_checked
from .scalars import changed_scalars, with_scalars
from .spec import FileHeader, Segments

log = logging.getLogger("astage.format")


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Kept:
    """A parsed header, with the structure bytes a later one must equal to share its plan."""

    header: FileHeader
    key: StructureKey
    """The header's structure bytes."""
    charged: int
    """What the structure charged against the parse bound."""
    scalars: tuple[Any, ...]
    """The kept plan's scalar values, in table order."""
    trails: tuple[Trail, ...]
    """Where each scalar sits in the kept plan, in table order."""


class HeaderCache:
    """Parses headers as :func:`~astage._format.codec.parse_prefix` does, re-using the last
    header's plan for one of the same structure.

    Invalidation rule: the kept plan is re-used only for a header whose structure bytes
    (table counts, tensor and dims tables, storage table less its checksums, structure
    document) equal
    the kept header's byte for byte and whose parse budget covers what the kept structure
    charged; any other header is parsed in full and replaces it.

    Holds the last header and its structure bytes (at most its header's length).  Not
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
        if kept is not None and prefix.budget >= kept.charged and prefix.has_structure(kept.key):
            reused = _reuse(kept, prefix)
            if reused is not None:
                self.reused += 1
                self._kept = reused
                return reused.header
        self._kept = None
        header, charged = parse_checked(prefix)
        # The key is copied out of the prefix only now: the parse bound counts the text
        # once, so it must not be held twice through the parse.
        key = prefix.structure_key()
        trails = drive(scalar_trails_in_slices(header.plan.root))
        scalars = tuple(_scalars(header.plan, trails))
        self._kept = _Kept(header, key, charged, scalars, trails)
        return header


def _scalars(plan: StagePlan, trails: tuple[Trail, ...]) -> list[Any]:
    """The plan's scalar values at ``trails``."""
    out = []
    for trail in trails:
        node: Any = plan.root
        for i in trail:
            node = plan_children(node)[i]
        out.append(node.value)
    return out


def _reuse(kept: _Kept, prefix: CheckedPrefix) -> _Kept | None:
    """``kept`` for ``prefix``'s header, made from the kept plan (its structure bytes are
    the kept ones) with its scalars in, or ``None`` if a full parse is needed."""
    try:
        meta, scalars = parse_values(load_document(prefix.values, "values"))
    except IntegrityError:
        return None  # the full parse raises its own error
    old = kept.header
    if meta["body_nbytes"] != old.body_nbytes or len(scalars) != len(kept.scalars):
        return None
    changed = [(kept.trails[k], scalars[k]) for k in changed_scalars(kept.scalars, scalars)]
    plan = old.plan
    if changed:
        plan = dataclasses.replace(plan, root=with_scalars(plan.root, changed))
    records = prefix.tables.storages
    segments = Segments(records["offset"], records["nbytes"], records["crc32c"])
    log.debug("header of step %d parsed with the kept plan of step %d", meta["step"], old.step)
    header = FileHeader(
        **meta, prefix_nbytes=prefix.total, segments=segments, plan=plan, dtensors=old.dtensors
    )
    return dataclasses.replace(kept, header=header, scalars=tuple(scalars))
