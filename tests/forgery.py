"""Forging checkpoint file headers for tests: a header's parts taken apart and put back.

A header is the binary tables (four counts, the tensor, dims and storage records), then
the structure document and the values document (docs/format.md).  These helpers split an
encoded prefix into those parts as JSON, and join edited parts into a prefix with a right
checksum, so a test can hand a reader exactly the damage it means.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import crc32c

from astage._format.codec import ALIGNMENT, FIXED_PREFIX_NBYTES, FORMAT_VERSION, MAGIC

STRUCTURE_KEYS = ("dtensors", "tree")


def header_bytes(data: bytes) -> bytes:
    """The header of the prefix at the start of ``data``."""
    return data[FIXED_PREFIX_NBYTES : FIXED_PREFIX_NBYTES + struct.unpack_from("<Q", data, 12)[0]]


def wrap(header: bytes, version: int = FORMAT_VERSION) -> bytes:
    """A prefix around ``header`` (any bytes), its checksum and alignment right."""
    head = MAGIC + struct.pack("<IQ", version, len(header)) + header
    head += struct.pack("<I", crc32c.crc32c(head))
    return head + bytes(-len(head) % ALIGNMENT)


def split(data: bytes) -> tuple[bytes, dict[str, Any]]:
    """The binary tables of ``data``'s header (its counts' structure length left to
    :func:`join`) and its two documents merged into one dict (the structure's members, then
    the values'), with the padding's length under ``"padding"``."""
    header = header_bytes(data)
    counts = struct.unpack_from("<QQQQ", header)
    at = 32 + 16 * counts[0] + 8 * counts[1] + 24 * counts[2]
    structure = json.loads(header[at : at + counts[3]])
    values_text = header[at + counts[3] :]
    values = json.loads(values_text)
    padding = len(values_text) - len(values_text.rstrip(b" "))
    return header[:at], {**structure, **values, "padding": padding}


def join(tables: bytes, doc: dict[str, Any], version: int = FORMAT_VERSION, **json_args: Any) -> bytes:
    """A prefix of ``tables`` (their structure count set) and ``doc`` (as :func:`split`
    gives it) split back into its two documents, padded as it was."""
    doc = dict(doc)
    padding = doc.pop("padding", 0)
    structure = {key: doc.pop(key) for key in STRUCTURE_KEYS if key in doc}
    return join_texts(
        tables, dumps(structure, **json_args), dumps(doc, **json_args) + b" " * padding, version
    )


def join_texts(tables: bytes, structure: bytes, values: bytes, version: int = FORMAT_VERSION) -> bytes:
    """A prefix of ``tables`` (their structure count set), then these texts as they are."""
    counts = struct.unpack_from("<QQQ", tables) if tables else (0, 0, 0)
    return wrap(struct.pack("<QQQQ", *counts, len(structure)) + tables[32:] + structure + values, version)


def dumps(value: Any, **json_args: Any) -> bytes:
    return json.dumps(value, **{"separators": (",", ":"), **json_args}).encode()


def values_doc(scalars: list[Any], body_nbytes: int = 0) -> dict[str, Any]:
    """A valid values document: this astage's metadata, then ``scalars``."""
    return {
        "format": FORMAT_VERSION,
        "owner_rank": 0,
        "holder_rank": None,
        "step": 0,
        "checkpoint_id": "",
        "created": 1.5,
        "body_nbytes": body_nbytes,
        "scalars": scalars,
    }
