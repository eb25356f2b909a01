"""The format's bulk paths: storage views sliced from one address range, and headers that
take the parser's column-at-a-time paths or not, read alike."""

from __future__ import annotations

import dataclasses
import gc
import json
import struct
from typing import Any

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from astage._format import codec as _format
from astage._format.codec import Segment, Segments
from astage._format.encoded import storage_views as _storage_views
from astage._format.encoder import _FilePlanner
from astage._format.header_parser import HeaderParser
from astage._format.parse_bound import joined_cost, text_parse_cost, text_tokens, unpadded_len
from astage._format.spec import PARSE_AMPLIFICATION, PARSE_SLACK
from astage._format.tables import _rows, split_tables
from astage._format.tree_encoder import TreeEncoder
from astage._staging.plan import StagePlan
from astage._util.errors import IntegrityError
from astage._util.timeslice import drive
from tests.forgery import dumps, values_doc, wrap
from tests.format.test_format import _parse_peak


def _storages() -> list[torch.UntypedStorage]:
    # Empty storages (whose pointers may be null) first, last and between; heap-sized and
    # mmap-sized allocations, which lie far apart; a numpy array's memory.
    tensors = [
        torch.empty(0),
        torch.arange(5, dtype=torch.int16),
        torch.full((1 << 20,), 3.0),
        torch.empty(0, dtype=torch.uint8),
        torch.from_numpy(np.arange(7, dtype=np.int64)),
        torch.tensor([1.5]),
        torch.empty(0),
    ]
    return [t.untyped_storage() for t in tensors]


def test_storage_views_are_exactly_each_storages_bytes() -> None:
    storages = _storages()
    views = list(_storage_views(storages))
    assert [len(v) for v in views] == [s.nbytes() for s in storages]
    for view, storage in zip(views, storages, strict=True):
        assert view.readonly
        expected = torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()
        assert bytes(view) == expected
        assert crc32c.crc32c(view) == crc32c.crc32c(expected)


def test_storage_views_of_only_empty_storages() -> None:
    storages = [torch.empty(0).untyped_storage() for _ in range(3)]
    assert [bytes(v) for v in _storage_views(storages)] == [b""] * 3
    assert list(_storage_views([])) == []


def test_an_encoded_file_of_scattered_and_empty_storages_round_trips() -> None:
    state = {f"t{i}": torch.empty(0, dtype=torch.uint8).set_(s) for i, s in enumerate(_storages())}
    encoded = _format.encode(state, owner_rank=0, step=1, checkpoint_id="views")
    body = torch.frombuffer(bytearray(b"".join(encoded.buffers())[len(encoded.prefix) :]), dtype=torch.uint8)
    got = _format.decode(_format.parse_prefix(encoded.prefix), body)
    assert got.keys() == state.keys()
    for key, tensor in state.items():
        assert torch.equal(got[key], tensor)


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=40).filter(lambda b: not b.endswith(b" ")),
    st.integers(0, 200_000),
    st.integers(0, 7),
    st.binary(max_size=3),
)
def test_unpadded_len_is_the_length_without_trailing_spaces(
    text: bytes, spaces: int, skew: int, tail: bytes
) -> None:
    # Unaligned views, padding across the doubling blocks, a non-space after the padding.
    raw = bytes(skew) + text + b" " * spaces + tail
    view = memoryview(raw)[skew:]
    assert unpadded_len(view) == len(bytes(view).rstrip(b" "))
    assert unpadded_len(bytes(view)) == len(bytes(view).rstrip(b" "))


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 64 << 10, (64 << 10) + 3, 200_003])
def test_unpadded_len_of_spaces_only_and_of_no_spaces(length: int) -> None:
    assert unpadded_len(b" " * length) == 0
    assert unpadded_len(b"x" * length) == length
    assert unpadded_len(b"x" + b" " * length) == 1


_REF = st.one_of(
    st.builds(lambda i: ["tensor", i], st.integers(-2, 12)),
    st.sampled_from([["tensor", True], ["tensor", 1.0], ["tensor"], ["tensor", 0, 0], [["tensor"], 0]]),
    st.sampled_from([5, None, [], ["ref", 0], ["list", []], "te", "tensor", {"tensor": 1, "x": 2}]),
    st.sampled_from([["tensor", "1"], [1, "tensor"], ["tensor", [0]], ["tensor", 2**70]]),
)


@st.composite
def _references(draw: st.DrawFn) -> list[Any]:
    """Tensor references as a container holds them: mostly runs (consecutive, as the encoder
    numbers tensors), some shuffled or damaged."""
    first, count = draw(st.integers(-1, 10)), draw(st.integers(1, 10))
    refs: list[Any] = [["tensor", i] for i in range(first, first + count)]
    if draw(st.booleans()):
        refs = draw(st.permutations(refs))
    for _ in range(draw(st.integers(0, 2))):
        refs[draw(st.integers(0, len(refs) - 1))] = draw(_REF)
    return refs


def _outcome(bulk: bool, refs: list[Any], taken: list[int], path: tuple[Any, ...]) -> Any:
    parser = HeaderParser(0, 1 << 20, split_tables(bytes(32)))
    parser.paths = [None] * 10
    for index in taken:
        parser.paths[index] = ("elsewhere",)
    keys = [f"k{i}" for i in range(len(refs))]
    children = parser.children if bulk else parser.mixed_children
    try:
        nodes = children(keys, json.loads(json.dumps(refs)), path, 1)
    except IntegrityError as exc:
        return str(exc)
    return nodes, parser.paths, parser.budget


@settings(max_examples=400, deadline=None)
@given(_references(), st.lists(st.integers(0, 9), max_size=3), st.sampled_from([(), ("a",), ("a", 3)]))
def test_a_container_of_tensor_references_parses_in_bulk_as_child_by_child(
    refs: list[Any], taken: list[int], path: tuple[Any, ...]
) -> None:
    assert _outcome(True, refs, taken, path) == _outcome(False, refs, taken, path)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 30),
    st.integers(0, 5),
    st.sampled_from([3, 1 << 20, (1 << 63) - 1]),
    st.randoms(use_true_random=False),
)
def test_rows_are_the_blocks_rows_equal_ones_shared(count: int, width: int, top: int, rng: Any) -> None:
    block = np.array([[rng.randrange(top) for _ in range(width)] for _ in range(count)], np.int64)
    block = block.reshape(count, width)
    rows = _rows(block).tolist()
    assert rows == [tuple(row) for row in block.tolist()]
    assert all(type(row) is tuple for row in rows)
    assert len({id(row) for row in rows}) == len(set(rows))


def test_segments_read_as_a_sequence_of_records() -> None:
    records = [(0, 10, 7), (64, 0, 0), (64, 5, (1 << 32) - 1)]
    segments = Segments.of(records)
    assert len(segments) == 3
    assert list(segments) == [Segment(*r) for r in records]
    assert all(type(s) is Segment for s in segments)
    assert segments[2] == Segment(64, 5, (1 << 32) - 1)
    assert segments[-1].crc32c == (1 << 32) - 1
    assert type(segments[0].offset) is int
    assert list(segments.columns()) == records
    assert segments[1:] == Segments.of(records[1:]) == records[1:]
    assert segments == records
    assert segments != records[:2]
    assert segments != Segments.of(records[:2])
    assert hash(segments) == hash(Segments.of(records))
    assert Segments.of([]) == ()
    assert len(Segments.of([])) == 0
    with pytest.raises(ValueError, match="read-only"):
        segments.offsets[0] = 1


def test_segments_keep_no_view_of_the_columns_they_were_given() -> None:
    offsets = np.array([0, 64], np.uint64)
    segments = Segments(offsets, np.array([3, 4]), np.array([1, 2], np.uint32))
    offsets[1] = 128
    assert segments[1].offset == 64


def test_a_parsed_header_makes_no_segment_records() -> None:
    state = {f"t{i}": torch.full((i + 1,), float(i)) for i in range(50)}
    encoded = _format.encode(state, owner_rank=0, step=1, checkpoint_id="lazy")
    gc.collect()
    before = sum(type(o) is Segment for o in gc.get_objects())
    header = _format.parse_prefix(encoded.prefix)
    assert sum(type(o) is Segment for o in gc.get_objects()) == before
    assert header.segments == encoded.header.segments
    assert len(header.segments) == 50


@pytest.mark.parametrize(
    "items",
    [
        [[0] * 200_000, [0] * 200_000],
        ["a" * 400_000, "b" * 400_000],
        [{str(i): 0 for i in range(40_000)}] * 2,
    ],
    ids=["long lists", "long strs", "wide objects"],
)
def test_a_container_of_long_equal_items_is_parsed_within_the_bound(items: list[Any]) -> None:
    # The bulk path splits a container's items with one zip: it must not zip long ones.
    structure = dumps({"dtensors": [], "tree": ["list", items]})
    header = struct.pack("<QQQQ", 0, 0, 0, len(structure)) + structure + dumps(values_doc([]))
    peak, parsed = _parse_peak(wrap(header))
    assert not parsed
    assert peak <= PARSE_AMPLIFICATION * len(header) + PARSE_SLACK, peak / len(header)


@pytest.mark.parametrize(
    ("checkpoint_id", "key"),
    [("plain", "k"), ("caf\u00e9", "k"), ("id", "\u00e9t\u00e9"), ("a\\u", "b\\u"), ("\\", "\u4e00\\")],
)
def test_the_encoder_counts_each_header_text_as_a_reader_does(checkpoint_id: str, key: str) -> None:
    # The structure's tokens are counted once a layout; a header's text is that and its values.
    state = {key: torch.zeros(2), "n": [1, 2.5, None, "s", {"x": 10**30}], "s": ["\u00e9", key]}
    layout = _format.lay_out(state, owner_rank=1, step=2, checkpoint_id=checkpoint_id)
    for holder in (None, 7, 2**31 - 1):
        parts, _ = dataclasses.replace(layout, holder_rank=holder).header_parts([0])
        structure, values = parts[-2:]
        assert structure == layout.structure_json.encode()
        pieces = [layout.structure_tokens, text_tokens(values)]
        assert joined_cost(pieces, len(structure + values)) == text_parse_cost(structure + values)


def _first_error(body: bytes, segments: list[tuple[int, int, int]]) -> str | None:
    """verify_body's verdict, checked the plain way: storage by storage, gap then checksum."""
    end = 0
    for index, (offset, nbytes, crc) in enumerate(segments):
        if any(body[end:offset]):
            return f"non-zero padding before storage {index}"
        if crc32c.crc32c(body[offset : offset + nbytes]) != crc:
            return f"checksum mismatch in storage {index} (body bytes from {offset})"
        end = offset + nbytes
    return None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 200), min_size=1, max_size=40),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=3),
    st.randoms(use_true_random=False),
)
def test_a_body_is_verified_as_storage_by_storage(
    sizes: list[int], flips: list[tuple[int, int]], rng: Any
) -> None:
    state = {
        f"s{i}": torch.tensor([rng.randrange(256) for _ in range(n)], dtype=torch.uint8)
        for i, n in enumerate(sizes)
    }
    encoded = _format.encode(state, owner_rank=0, step=1, checkpoint_id="gaps")
    header = _format.parse_prefix(encoded.prefix)
    body = bytearray(b"".join(encoded.buffers())[len(encoded.prefix) :])
    for at, value in flips:  # into a gap or a storage, anywhere
        if body:
            body[at % len(body)] ^= value
    expected = _first_error(bytes(body), list(header.segments.columns()))
    tensor = torch.frombuffer(body, dtype=torch.uint8) if body else torch.zeros(0, dtype=torch.uint8)
    verdict = None
    try:
        _format.verify_body(header, tensor)
    except IntegrityError as exc:
        verdict = str(exc)
    assert verdict == expected


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 400),
    st.integers(0, 2**32 - 1),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=3),
    st.lists(st.integers(1, 40_000), min_size=1, max_size=6),
)
def test_a_streamed_body_is_verified_as_storage_by_storage(
    count: int, seed: int, flips: list[tuple[int, int]], pieces: list[int]
) -> None:
    # A receiver verifies the body in the pieces the wire cuts it into: whatever the cut,
    # through storages and gaps, its verdict (first fault first) is the plain one.  Hundreds
    # of storages of 0-200 bytes, up to three damaged bytes anywhere.
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 201, (count,), generator=gen).tolist()
    state = {
        f"s{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for i, n in enumerate(sizes)
    }
    encoded = _format.encode(state, owner_rank=0, step=1, checkpoint_id="stream")
    header = _format.parse_prefix(encoded.prefix)
    body = bytearray(b"".join(encoded.buffers())[len(encoded.prefix) :])
    for at, value in flips:
        if body:
            body[at % len(body)] ^= value
    expected = _first_error(bytes(body), list(header.segments.columns()))
    verifier = _format.BodyVerifier(header)
    verdict = None
    try:
        start, cuts = 0, iter(pieces * (len(body) // min(pieces) + 1))
        while start < len(body):
            step = next(cuts)
            verifier.update(body[start : start + step])
            start += step
        verifier.finish()
    except IntegrityError as exc:
        verdict = str(exc)
    assert verdict == expected


def test_the_tree_encoder_skips_no_charge_when_every_tensor_is_storable() -> None:
    shared = torch.ones(3)
    state = {"a": {"b": [shared, torch.zeros(2), (shared, {"c": torch.ones(1)})]}, "d": torch.ones(2, 2)}
    planner = _FilePlanner()
    root = drive(planner.walk(state, ()))
    plan = StagePlan(root, tuple(planner.tensors), tuple(planner.storages))
    fast, slow = TreeEncoder(plan), TreeEncoder(plan)
    assert fast.storable
    slow.storable = False
    assert drive(fast.node(plan.root, (), 0)) == drive(slow.node(plan.root, (), 0))
    assert fast.charged == slow.charged > 0
    assert fast.seen == slow.seen == set(range(len(plan.tensors)))
    assert fast.scalars == slow.scalars
