"""The parse bound: what reading a checkpoint file header may allocate, counted before it is parsed.

A reader refuses a header that could need more than :data:`PARSE_AMPLIFICATION` times its
length (plus :data:`PARSE_SLACK`), from a count of its tokens made at C speed and the sizes
of its binary tables; the structure-dependent charges (key paths, namedtuple classes,
DTensor notes) are made as the parse meets them.  Every charge comes from one table,
:data:`NODE_COSTS` (one entry per kind of thing a parse meets), and the encoder counts the
same charges from the same table and pads the header with spaces to fit: whatever the
writer accepts, a reader parses.  Pure: no file, socket or thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple

import numpy as np

from .spec import PARSE_AMPLIFICATION, PARSE_SLACK


class NodeCost(NamedTuple):
    """What parsing one node of a kind allocates beyond its text's tokens (bytes).

    ``base`` a node, plus ``each`` per item it holds (a key of a key path, a field of a
    namedtuple, a dimension of a DTensor's global shape), plus ``char`` per character of
    the names it holds (Python makes code from a namedtuple's names).
    """

    base: int
    each: int = 0
    char: int = 0

    def of(self, items: int = 0, chars: int = 0) -> int:
        """The charge of one node holding ``items`` items named with ``chars`` characters."""
        return self.base + self.each * items + self.char * chars


NODE_COSTS: Final[Mapping[str, NodeCost]] = {
    # The JSON text's tokens, counted before the parse (:func:`text_tokens`): a value is
    # a pointer in its JSON list, an object (an int, a float, an AtomNode in the plan) and
    # its slot in a plan tuple; a quote pair is a str object; a colon is an object member
    # (a pair tuple while the object is built, a dict slot after); a digit, a long int's.
    "value": NodeCost(80),
    "quote": NodeCost(30),
    "member": NodeCost(100),
    "digit": NodeCost(10),
    # The binary tables, known from their counts: a tensor's TensorSpec, its
    # columns' temporaries, its Segment and checks; a dims entry's ints, tuple slots and
    # index arrays (all shapes distinct: a tuple each); a storage's Segment and its ints.
    "tensor": NodeCost(200),
    "dim": NodeCost(40),
    "storage": NodeCost(200),
    # The structure, charged as the parse meets it: a tensor's key path (a tuple of its
    # keys, stored in its TensorSpec); a namedtuple class, which collections.namedtuple
    # makes by compiling Python source with a parameter a field (~1.7 KB a field at its
    # peak, and bytes more a character of the names); a DTensor note, an object and its
    # global shape's tuple.
    "key_path": NodeCost(48, 8),
    # A container's plan node (a DictNode or SeqNode and the tuples it holds): its JSON
    # list, tag and items are tokens, the node is not (~80 bytes short a container).
    "container": NodeCost(160),
    "namedtuple": NodeCost(24 << 10, 2 << 10, 16),
    "dtensor_note": NodeCost(96, 8, 1),
    # A scalar table entry: its value checked (a tagged one decoded) and the plan's
    # AtomNode that holds it; the entry's and its reference's tokens are counted as text.
    "scalar": NodeCost(64),
}
"""What a parse allocates (bytes, CPython 3.11, 64-bit), by what it meets: one entry per
node kind, measured on the densest headers of each (``tests/test_parse_cost.py`` checks
that what these charge bounds the real peak).  A kind of node added to the format adds an
entry here, charged by the parser and the encoder alike."""

_DIGITS: Final = b"0123456789"
_SCAN: Final = 64 << 10  # bytes in the first step of the backwards search for the padding
_SPACES: Final = np.frombuffer(b" " * 8, np.uint64)[0]
_COST_VALUE: Final = NODE_COSTS["value"].base
_COST_QUOTE: Final = NODE_COSTS["quote"].base
_COST_MEMBER: Final = NODE_COSTS["member"].base
_COST_DIGIT: Final = NODE_COSTS["digit"].base
_COST_TENSOR: Final = NODE_COSTS["tensor"].base
_COST_DIM: Final = NODE_COSTS["dim"].base
_COST_STORAGE: Final = NODE_COSTS["storage"].base
_COST_PATH: Final = NODE_COSTS["key_path"].base
_COST_KEY: Final = NODE_COSTS["key_path"].each


def path_cost(keys: int) -> int:
    """The charge of a tensor's key path of ``keys`` keys."""
    return _COST_PATH + _COST_KEY * keys


def namedtuple_cost(typename: str, fields: Sequence[str]) -> int:
    """The charge of making a namedtuple class (once a class a header)."""
    return NODE_COSTS["namedtuple"].of(len(fields), len(typename) + sum(map(len, fields)))


def note_cost(placements: str, ndim: int) -> int:
    """The charge of a DTensor note: ``placements`` and a global shape of ``ndim`` dimensions."""
    return NODE_COSTS["dtensor_note"].of(ndim, len(placements))


def container_cost() -> int:
    """The charge of a container's plan node (a dict, list, tuple or namedtuple)."""
    return NODE_COSTS["container"].base


def scalars_cost(count: int) -> int:
    """The charge of a scalar table of ``count`` entries."""
    return NODE_COSTS["scalar"].base * count


def text_parse_cost(raw: bytes | memoryview, unpadded: int | None = None) -> int:
    """An upper bound on what parsing JSON header text ``raw`` allocates, its padding included.

    Counted, not parsed: a few ``bytes.count`` passes and one ``translate`` (C speed).
    Values, strings, members and digits are charged by :data:`NODE_COSTS`; the text itself
    once; the text without its trailing spaces (the padding) twice more, for string
    contents and transients, or five times where a backslash-u escape can widen a string
    to four bytes a character.  Tensor key paths, namedtuple classes and DTensor notes
    depend on the structure, so the parser charges them as it meets them
    (:class:`~astage._format.header_parser.HeaderParser`) and the encoder counts them the same
    way (:class:`~astage._format.tree_encoder.TreeEncoder`).  ``unpadded``: the :func:`unpadded_len`
    of ``raw``, where the caller has it.
    """
    if unpadded is None:
        unpadded = unpadded_len(raw)
    text = bytes(raw[:unpadded])  # the padding holds no tokens: not scanned (or copied)
    return len(raw) - unpadded + joined_cost([text_tokens(text)], unpadded)


class Tokens(NamedTuple):
    """What a piece of header text's tokens cost (:func:`text_parse_cost`), and whether it
    holds a backslash-u escape: a text's cost is its pieces' summed (:func:`joined_cost`)."""

    cost: int
    escapes: bool


def text_tokens(text: bytes) -> Tokens:
    """The :class:`Tokens` of ``text``, which has no padding."""
    values = text.count(b",") + text.count(b"[") + text.count(b"{")
    digits = len(text) - len(text.translate(None, _DIGITS))
    cost = (
        _COST_VALUE * values
        + _COST_QUOTE * text.count(b'"')
        + _COST_MEMBER * text.count(b":")
        + _COST_DIGIT * digits
    )
    return Tokens(cost, b"\\" in text and b"\\u" in text)  # a byte is found faster than two


def joined_cost(pieces: Sequence[Tokens], length: int) -> int:
    """:func:`text_parse_cost` of an unpadded text of ``length`` bytes made of these pieces
    (joined where no escape can straddle two of them)."""
    escapes = any(piece.escapes for piece in pieces)
    return length + (5 if escapes else 2) * length + _COST_VALUE + sum(piece.cost for piece in pieces)


def unpadded_len(raw: bytes | memoryview) -> int:
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


def tables_cost(tensors: int, dims: int, storages: int) -> int:
    """What parsing tables of these sizes allocates: checks and Python objects."""
    return _COST_TENSOR * tensors + _COST_DIM * dims + _COST_STORAGE * storages


def parse_budget(
    header_len: int, text: bytes | memoryview, table_cost: int, unpadded: int | None = None
) -> int:
    """What is left for the structure-dependent charges; negative: refuse the header.

    ``header_len`` is the whole header, ``text`` its JSON (after the tables), ``unpadded``
    as :func:`text_parse_cost`.
    """
    if unpadded is None:
        unpadded = unpadded_len(text)
    held = header_len - (len(text) - unpadded)
    return _budget(header_len, text_parse_cost(text, unpadded) + table_cost, held)


def _budget(header_len: int, cost: int, held: int) -> int:
    """The bound less ``cost`` and ``held``, the header without its padding (which
    :func:`text_parse_cost` charges once already): the bytes a reader holds through the parse."""
    return PARSE_AMPLIFICATION * header_len + PARSE_SLACK - cost - held


def pad_spaces(text_len: int, text_cost: int, binary_len: int, charged: int) -> int:
    """How many trailing spaces make a header fit :data:`PARSE_AMPLIFICATION`: its JSON text
    is ``text_len`` bytes and costs ``text_cost`` (:func:`text_parse_cost`, unpadded).

    A space adds one byte of length and one of cost, so ``p`` spaces raise the budget by
    ``3p``.  ``binary_len`` bytes of tables precede the text in the header; ``charged`` is
    what the tables and the tree's structure cost beyond the text's tokens.
    """
    unpadded = binary_len + text_len
    short = -_budget(unpadded, text_cost, unpadded) + charged
    return max(0, -(-short // (PARSE_AMPLIFICATION - 1)))
