"""Reading a checkpoint file's prefix: the fixed fields, the checksum, the parse bound, the header.

:func:`prefix_nbytes` sizes a prefix from its first 20 bytes; :func:`check_prefix` checks
everything but the JSON (length, checksum, padding, the tables' sizes, the parse bound);
:func:`parse_checked` parses and checks the header's two documents
(:class:`~astage._format.header_parser.HeaderParser`).  Only :data:`FORMAT_VERSION` is read.
Pure: no file, socket or thread.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Final, NamedTuple

import crc32c
import numpy as np

from .._util.collector import without_gc
from .._util.errors import IntegrityError
from .header_parser import HeaderParser, reject_constant, unique_keys
from .parse_bound import parse_budget, tables_cost, text_parse_cost, unpadded_len
from .spec import (
    FIXED_FIELDS,
    FIXED_PREFIX_NBYTES,
    HEADER_CAP,
    HEADER_CRC,
    MAGIC,
    FileHeader,
    align_up,
    check_version,
)
from .tables import COUNTS, RawTables, split_tables


def prefix_nbytes(fixed: bytes | bytearray | memoryview) -> int:
    """Length of the whole prefix, from its first :data:`FIXED_PREFIX_NBYTES` bytes.

    Checks magic, version and the header length cap, so a reader can size its next read
    without trusting anything else.

    :raises IntegrityError: fewer than 20 bytes, wrong magic or version, header too long.
    """
    if len(fixed) < FIXED_PREFIX_NBYTES:
        raise IntegrityError(
            f"truncated: {len(fixed)} bytes, a checkpoint file starts with {FIXED_PREFIX_NBYTES}"
        )
    magic, version, header_len = FIXED_FIELDS.unpack(bytes(fixed[:FIXED_PREFIX_NBYTES]))
    if magic != MAGIC:
        raise IntegrityError(f"not an astage checkpoint file: magic {magic!r}")
    check_version(version)
    if header_len > HEADER_CAP:
        raise IntegrityError(f"header length {header_len} is over the {HEADER_CAP}-byte cap")
    return align_up(FIXED_PREFIX_NBYTES + header_len + HEADER_CRC.size)


@without_gc
def parse_prefix(data: bytes | bytearray | memoryview) -> FileHeader:
    """Validate a checkpoint file's prefix and return its header; bytes after the prefix are ignored.

    :raises IntegrityError: truncated, corrupt, tampered or malformed in any way.
    """
    return parse_checked(check_prefix(data))[0]


@dataclasses.dataclass(slots=True, eq=False)
class CheckedPrefix:
    """A prefix checked up to its JSON (:func:`check_prefix`), which is not parsed yet.

    :ivar structure: the structure document's text; :func:`parse_checked` takes it (it
        must not outlive the parse's start: the parse bound counts the text once).
    :ivar values: the values document's text (metadata and scalar table), unpadded.
    :ivar budget: what the parse may still charge for the structure (``parse_bound``).
    """

    total: int
    tables: RawTables
    structure: str
    values: str
    budget: int
    view: memoryview
    structure_at: slice

    def structure_key(self) -> StructureKey:
        """The parts of the prefix a header's plan is made from but for its scalar values:
        the counts, the tensor table and the dims array, the storage table without its
        checksums, the structure document (read from the prefix: valid after
        :func:`parse_checked` too)."""
        storages = self.tables.storages
        structure = str(self.view[self.structure_at], "ascii")
        return StructureKey(self._records(), storages["offset"].copy(), storages["nbytes"].copy(), structure)

    def has_structure(self, key: StructureKey) -> bool:
        """Whether this prefix's structure bytes are ``key``'s (before it is parsed)."""
        storages = self.tables.storages
        return (
            self.structure == key.structure
            and np.array_equal(storages["offset"], key.offsets)
            and np.array_equal(storages["nbytes"], key.nbytes)
            and self._records() == key.records
        )

    def _records(self) -> bytes:
        """The counts, the tensor table and the dims array, as they lie in the prefix."""
        tables = self.tables
        at = self.structure_at.start - tables.nbytes
        return bytes(self.view[at : at + COUNTS.size + tables.tensors.nbytes + tables.dims.nbytes])


class StructureKey(NamedTuple):
    """A header's structure bytes (:meth:`CheckedPrefix.structure_key`), kept to compare."""

    records: bytes
    """The counts, the tensor table and the dims array."""
    offsets: np.ndarray[Any, Any]
    nbytes: np.ndarray[Any, Any]
    """The storage table's offset and length columns."""
    structure: str
    """The structure document."""


def check_prefix(data: bytes | bytearray | memoryview) -> CheckedPrefix:
    """What every parse checks before it reads the JSON: length, checksum, padding, the
    tables' sizes and the parse bound.

    :raises IntegrityError: as :func:`parse_prefix`.
    """
    view = memoryview(data).cast("B")
    total = prefix_nbytes(view)
    if len(view) < total:
        raise IntegrityError(f"truncated: the prefix is {total} bytes, only {len(view)} available")
    header_len = FIXED_FIELDS.unpack(bytes(view[:FIXED_PREFIX_NBYTES]))[2]
    header_end = FIXED_PREFIX_NBYTES + header_len
    (stored,) = HEADER_CRC.unpack(view[header_end : header_end + HEADER_CRC.size])
    if crc32c.crc32c(view[:header_end]) != stored:
        raise IntegrityError("header checksum mismatch")
    if any(view[header_end + HEADER_CRC.size : total]):
        raise IntegrityError("non-zero bytes in the prefix padding")
    # Views, not copies: most of a many-tensor header is padding, which is only counted.
    raw = view[FIXED_PREFIX_NBYTES:header_end]
    tables = split_tables(raw)
    json_raw = raw[tables.nbytes :]
    table_cost = tables_cost(*tables.counts)
    unpadded = unpadded_len(json_raw)
    budget = parse_budget(header_len, json_raw, table_cost, unpadded)
    if budget < 0:
        raise IntegrityError(
            f"header of {header_len} bytes is too dense: parsing it could allocate "
            f"{text_parse_cost(json_raw, unpadded) + table_cost} bytes, more than its bound (docs/format.md)"
        )
    split = tables.structure_len
    if split > unpadded:
        raise IntegrityError(f"header structure of {split} bytes runs into the padding")
    structure, values = _ascii(json_raw[:split]), _ascii(json_raw[split:unpadded])
    at = FIXED_PREFIX_NBYTES + tables.nbytes
    return CheckedPrefix(total, tables, structure, values, budget, view, slice(at, at + split))


def _ascii(raw: memoryview) -> str:
    try:
        return str(raw, "ascii")
    except UnicodeDecodeError as exc:  # the encoder escapes every non-ASCII character
        raise IntegrityError(f"header is not ASCII: {exc}") from exc


_DECODER: Final = json.JSONDecoder(parse_constant=reject_constant, object_pairs_hook=unique_keys)
"""A header document as the parse reads it: no NaN constants, no repeated keys."""


def load_document(text: str, what: str) -> Any:
    """One of a header's JSON documents, strictly.

    :raises IntegrityError: not valid JSON, or nested too deep for the parser.
    """
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"header {what} is not valid JSON: {exc}") from exc


def parse_checked(prefix: CheckedPrefix) -> tuple[FileHeader, int]:
    """The header of a :func:`check_prefix`-ed prefix, and what its structure charged
    against the parse bound.

    :raises IntegrityError: as :func:`parse_prefix`.
    """
    text, prefix.structure = prefix.structure, ""
    structure = load_document(text, "structure")
    del text
    values = load_document(prefix.values, "values")
    parser = HeaderParser(prefix.total, prefix.budget, prefix.tables)
    header = parser.parse(structure, values)
    del structure, values
    return header, prefix.budget - parser.budget
