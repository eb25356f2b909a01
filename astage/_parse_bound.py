"""The parse bound: what parsing a checkpoint file header may allocate, counted before it is parsed.

A reader refuses a header that could need more than :data:`PARSE_AMPLIFICATION` times its
length (plus :data:`PARSE_SLACK`), from a count of its tokens made at C speed; the
structure-dependent charges (key paths, namedtuple classes) are made as the parse meets
them, and the encoder counts them the same way and pads the header with spaces to fit, so
an honest header is never refused.  Pure: no file, socket or thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple

import numpy as np

from ._format_spec import FORMAT_VERSION, LEGACY_PARSE_AMPLIFICATION, PARSE_AMPLIFICATION, PARSE_SLACK

# What parsing may allocate, per token of the header text (bytes, CPython 3.11, 64-bit),
# measured on the densest headers of each kind (tests/test_format.py checks the sum bounds
# the real peak): a value is a pointer in its JSON list, an object (an int, a float, an
# AtomNode in the plan) and its slot in a plan tuple; a quote pair is a str object; a colon
# is an object member (a pair tuple while the object is built, a dict slot after).
_COST_VALUE: Final = 80
_COST_QUOTE: Final = 30
_COST_COLON: Final = 100
_COST_DIGIT: Final = 10
_COST_PATH: Final = 48  # a tensor's key path, stored in its TensorSpec: a tuple, plus 8 per key
_COST_NAMEDTUPLE: Final = 8192  # a namedtuple class, plus 256 per field
# Version-3 tables, per record (measured like the rest, see tests/test_format.py): a tensor's
# TensorSpec, its columns' temporaries, its Segment and checks; a dimension's ints, tuple
# slots and index arrays; a storage's Segment and its three ints.
_COST_TENSOR: Final = 200
_COST_DIM: Final = 40
_COST_STORAGE: Final = 200
_DIGITS: Final = b"0123456789"
_SCAN: Final = 64 << 10  # bytes in the first step of the backwards search for the padding
_SPACES: Final = np.frombuffer(b" " * 8, np.uint64)[0]


def _parse_cost(raw: bytes | memoryview, unpadded: int | None = None) -> int:
    """An upper bound on what :func:`parse_prefix` allocates to parse header bytes ``raw``.

    Counted, not parsed: a few ``bytes.count`` passes and one ``translate`` (C speed).
    Values, strings, members and digits are charged by :data:`_COST_VALUE` and the like;
    the text itself once; the text without its trailing spaces (the padding) twice more,
    for string contents and transients, or five times where a backslash-u escape can widen
    a string to four bytes a character.  Tensor key paths and namedtuple classes depend on
    the structure, so the parser charges them as it meets them (:class:`_HeaderParser`) and
    the encoder counts them the same way (:class:`_TreeEncoder`).  ``unpadded``: the
    :func:`_unpadded_len` of ``raw``, where the caller has it.
    """
    if unpadded is None:
        unpadded = _unpadded_len(raw)
    text = bytes(raw[:unpadded])  # the padding holds no tokens: not scanned (or copied)
    return len(raw) - unpadded + _joined_cost([_text_tokens(text)], unpadded)


class _Tokens(NamedTuple):
    """What a piece of header text's tokens cost (:func:`_parse_cost`), and whether it
    holds a backslash-u escape: a text's cost is its pieces' summed (:func:`_joined_cost`)."""

    cost: int
    escapes: bool


def _text_tokens(text: bytes) -> _Tokens:
    """The :class:`_Tokens` of ``text``, which has no padding."""
    values = text.count(b",") + text.count(b"[") + text.count(b"{")
    digits = len(text) - len(text.translate(None, _DIGITS))
    cost = (
        _COST_VALUE * values
        + _COST_QUOTE * text.count(b'"')
        + _COST_COLON * text.count(b":")
        + _COST_DIGIT * digits
    )
    return _Tokens(cost, b"\\" in text and b"\\u" in text)  # a byte is found faster than two


def _joined_cost(pieces: Sequence[_Tokens], length: int) -> int:
    """:func:`_parse_cost` of an unpadded text of ``length`` bytes made of these pieces
    (joined where no escape can straddle two of them)."""
    escapes = any(piece.escapes for piece in pieces)
    return length + (5 if escapes else 2) * length + _COST_VALUE + sum(piece.cost for piece in pieces)


def _unpadded_len(raw: bytes | memoryview) -> int:
    """Length of ``raw`` without its trailing spaces; ``bytes.rstrip`` crawls over megabytes.

    Compared eight bytes at a time, in blocks that double from the end (a header's padding
    may be most of it).
    """
    end = len(raw)
    step = _SCAN
    while end >= 8:
        words = min(end, step) // 8
        start = end - 8 * words
        kept = np.frombuffer(raw, np.uint64, words, start) != _SPACES
        if kept.any():
            stop = end - 8 * int(np.argmax(kept[::-1]))  # the end of the last word kept
            return stop - 8 + len(bytes(raw[stop - 8 : stop]).rstrip(b" "))
        end = start
        step *= 2
    return len(bytes(raw[:end]).rstrip(b" "))


def _table_cost(tensors: int, dims: int, storages: int) -> int:
    """What parsing version-3 tables of these sizes allocates: checks and Python objects."""
    return _COST_TENSOR * tensors + _COST_DIM * dims + _COST_STORAGE * storages


def _parse_budget(
    header_len: int, text: bytes | memoryview, version: int, table_cost: int = 0, unpadded: int | None = None
) -> int:
    """What is left for the structure-dependent charges; negative: refuse the header.

    ``header_len`` is the whole header, ``text`` its JSON (all of it before version 3),
    ``unpadded`` as :func:`_parse_cost`.
    """
    return _budget(header_len, _parse_cost(text, unpadded) + table_cost, version)


def _budget(header_len: int, cost: int, version: int) -> int:
    factor = PARSE_AMPLIFICATION if version >= 2 else LEGACY_PARSE_AMPLIFICATION
    return factor * header_len + PARSE_SLACK - cost


def _padding(text_len: int, text_cost: int, binary_len: int, charged: int) -> int:
    """How many trailing spaces make a header fit :data:`PARSE_AMPLIFICATION`: its JSON text
    is ``text_len`` bytes and costs ``text_cost`` (:func:`_parse_cost`, unpadded).

    A space adds one byte of length and one of cost, so ``p`` spaces raise the budget by
    ``3p``.  ``binary_len`` bytes of tables precede the text in the header; ``charged`` is
    what the tables and the tree's structure cost beyond the text's tokens.
    """
    short = -_budget(binary_len + text_len, text_cost, FORMAT_VERSION) + charged
    return max(0, -(-short // (PARSE_AMPLIFICATION - 1)))
