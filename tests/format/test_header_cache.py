"""A holder parses a repeated structure's header once: what it re-uses, and what it never does."""

from __future__ import annotations

import collections
import copy
import json
import struct
from collections.abc import Callable
from typing import Any

import crc32c
import pytest
import torch

import astage
from astage._format.codec import FIXED_PREFIX_NBYTES, FORMAT_VERSION, check_prefix, encode, parse_prefix
from astage._format.header_cache import HeaderCache
from astage._format.spec import ALIGNMENT, MAGIC
from tests.forgery import split


def state(**changes: Any) -> dict[str, Any]:
    """A model-like state of 300 tensors in runs and small dicts, plus leaves."""
    out: dict[str, Any] = {
        "model": {f"w{i}": torch.randn(3, 4) for i in range(200)},
        "optim": {
            "state": {i: {"exp_avg": torch.randn(5), "step": torch.tensor(1.0)} for i in range(50)},
            "param_groups": [{"lr": 0.1, "params": list(range(50))}],
        },
    }
    out.update(changes)
    return out


def prefix(tree: Any, **meta: Any) -> bytes:
    return encode(tree, **{"owner_rank": 1, "step": 1, "checkpoint_id": "c", **meta}).prefix


def forge(data: bytes, edit: Callable[[bytes], bytes]) -> bytes:
    """``data``'s prefix with its header ``edit``-ed, checksum and alignment made right."""
    header_len = struct.unpack_from("<Q", data, 12)[0]
    header = edit(data[FIXED_PREFIX_NBYTES : FIXED_PREFIX_NBYTES + header_len])
    head = MAGIC + struct.pack("<IQ", FORMAT_VERSION, len(header)) + header
    head += struct.pack("<I", crc32c.crc32c(head))
    return head + bytes(-len(head) % ALIGNMENT)


def assert_parsed_as_in_full(cache: HeaderCache, data: bytes) -> None:
    assert cache.parse(data) == parse_prefix(data)


def assert_refused_as_in_full(cache: HeaderCache, data: bytes) -> None:
    with pytest.raises(astage.IntegrityError) as full:
        parse_prefix(data)
    with pytest.raises(astage.IntegrityError) as cached:
        cache.parse(data)
    assert str(cached.value) == str(full.value)


def test_a_repeated_structure_is_parsed_with_the_kept_plan_and_reads_as_a_full_parse() -> None:
    cache, tree = HeaderCache(), state()
    first = cache.parse(prefix(tree))
    metas: list[dict[str, Any]] = [
        {"step": 2, "checkpoint_id": "a much longer checkpoint id", "created": 1.5},
        {"step": -(2**63), "checkpoint_id": "", "holder_rank": 0, "created": 1e300},
        # A quote, an escape and the tree's own key inside the id: only escaped text.
        {"step": 10**12, "checkpoint_id": 'x","dtensors":[],"tree":{"a":1},"é\\', "owner_rank": 1},
    ]
    for meta in metas:
        for t in tree["model"].values():
            t.add_(1)  # new data: new checksums
        data = prefix(tree, **meta)
        header = cache.parse(data)
        assert header == parse_prefix(data)
        assert header.plan is first.plan  # re-used, not rebuilt
        assert list(header.segments.crcs) != list(first.segments.crcs)
    assert cache.reused == len(metas)


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "reshape": lambda s: s["model"].update(w3=s["model"]["w3"].view(4, 3)),
    "dtype": lambda s: s["model"].update(w3=s["model"]["w3"].double()),
    "same-size dtype": lambda s: s["model"].update(w3=s["model"]["w3"].view(torch.int32)),
    "new key": lambda s: s["model"].update(extra=torch.zeros(2)),
    "removed key": lambda s: s["model"].pop("w7"),
    "renamed key": lambda s: s["model"].update(v7=s["model"].pop("w7")),
    "key order": lambda s: s.update(model=dict(reversed(list(s["model"].items())))),
    "storage becomes shared": lambda s: s["model"].update(w5=s["model"]["w4"][1]),
    "transposed": lambda s: s["model"].update(w3=s["model"]["w3"].t()),
    "requires_grad": lambda s: s["model"]["w3"].requires_grad_(True),
    "scalar to list": lambda s: s["optim"]["param_groups"][0].update(lr=[0.1, 0.2]),
    "scalar to tensor": lambda s: s["optim"]["param_groups"][0].update(lr=torch.tensor(0.1)),
    "list to tuple": lambda s: s["optim"]["param_groups"][0].update(params=tuple(range(50))),
    "same bytes, other sizes": lambda s: s["model"].update(w3=torch.randn(6, 2)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_structure_is_parsed_in_full(change: str) -> None:
    cache, tree = HeaderCache(), state()
    kept = cache.parse(prefix(tree))
    CHANGES[change](tree)
    data = prefix(tree, step=2)
    header = cache.parse(data)
    assert header == parse_prefix(data)
    assert header.plan is not kept.plan
    assert header.plan != kept.plan
    assert cache.reused == 0
    assert cache.parse(prefix(tree, step=3)).plan is header.plan  # and kept for the next one


HOSTILE_META: dict[str, tuple[bytes, bytes]] = {
    "owner rank": (b'"owner_rank":1,', b'"owner_rank":-1,'),
    "created not a float": (b'"created":1.5,', b'"created":2,'),
    "format": (b'"format":%d,' % FORMAT_VERSION, b'"format":%d,' % (FORMAT_VERSION - 1)),
    "format as a float": (b'"format":%d,' % FORMAT_VERSION, b'"format":%d.0,' % FORMAT_VERSION),
    "holder rank": (b'"holder_rank":null,', b'"holder_rank":"0",'),
    "duplicate meta key": (b'"step":2,', b'"step":2,"step":3,'),
    "unknown meta key": (b'"step":2,', b'"step":2,"extra":0,'),
    "body size": (b'"body_nbytes":', b'"body_nbytes":1'),
    "NaN": (b'"created":1.5,', b'"created":NaN,'),
}


@pytest.mark.parametrize("case", list(HOSTILE_META))
def test_bad_metadata_over_a_kept_structure_raises_as_a_full_parse_does(case: str) -> None:
    old, new = HOSTILE_META[case]
    cache, tree = HeaderCache(), state()
    cache.parse(prefix(tree, created=1.5))
    data = prefix(tree, step=2, created=1.5)
    assert old in data
    assert_refused_as_in_full(cache, forge(data, lambda header: header.replace(old, new, 1)))
    assert cache.reused == 0
    assert_parsed_as_in_full(cache, data)  # the kept plan is still good


def test_a_damaged_table_or_tree_over_a_kept_structure_raises_as_a_full_parse_does() -> None:
    cache, tree = HeaderCache(), state()
    cache.parse(prefix(tree))
    data = prefix(tree, step=2)
    for damage in (
        lambda h: h.replace(b'"w199"', b'"w0"', 1),  # a duplicate key in the tree
        lambda h: h.replace(b'"w199"', b'"w19', 1),  # not JSON
        lambda h: h[:32] + bytes([h[32] ^ 1]) + h[33:],  # the first tensor record
    ):
        assert_refused_as_in_full(cache, forge(data, damage))
    assert cache.reused == 0


def test_a_kept_structure_with_too_little_padding_is_refused_as_too_dense() -> None:
    # The padding buys the parse's charges for the structure (key paths, here 300 tensors
    # 60 containers deep).  With just enough padding to pass the check before parsing, a
    # full parse runs out on those charges; a kept plan must not let the header by.
    tree: Any = {f"t{i}": torch.zeros(1) for i in range(300)}
    for _ in range(60):
        tree = {"x": tree}
    cache = HeaderCache()
    cache.parse(prefix(tree))
    data = prefix(tree, step=2)
    header_len = struct.unpack_from("<Q", data, 12)[0]
    unpadded = data[FIXED_PREFIX_NBYTES : FIXED_PREFIX_NBYTES + header_len].rstrip(b" ")
    messages = []
    for spaces in range(0, header_len - len(unpadded), 256):
        short = forge(data, lambda _: unpadded + b" " * spaces)  # noqa: B023 (called at once)
        try:
            parse_prefix(short)
        except astage.IntegrityError as exc:
            messages.append(str(exc))
        else:
            break
        with pytest.raises(astage.IntegrityError) as cached:
            cache.parse(short)
        assert str(cached.value) == messages[-1]
    # The last refusal came from the structure's charges, after the check before parsing.
    assert "more than its bound (text_parse_cost)" in messages[-1]
    assert cache.reused == 0
    assert_parsed_as_in_full(cache, data)


def test_a_header_laid_out_otherwise_is_re_used_only_where_its_structure_bytes_repeat() -> None:
    # Valid, but with each document's members in another order.  The values (reordered
    # here) are parsed every time; the structure (reordered too) is other bytes than the
    # encoder's, so its plan is kept for its own repeats and never for the encoder's header.
    cache = HeaderCache()
    data = prefix(state())

    def reorder(header: bytes) -> bytes:
        start = header.index(b'{"dtensors"')
        split = header.index(b'{"format"')
        structure, values = json.loads(header[start:split]), json.loads(header[split:])
        texts = [
            json.dumps(dict(reversed(list(doc.items()))), separators=(",", ":")).encode()
            for doc in (structure, values)
        ]
        counts = struct.pack("<QQQQ", *struct.unpack_from("<QQQ", header), len(texts[0]))
        body = counts + header[32:start] + b"".join(texts)
        return body + b" " * (len(header) - len(body))

    odd = forge(data, reorder)
    assert parse_prefix(odd) == parse_prefix(data)
    for _ in range(3):
        assert_parsed_as_in_full(cache, odd)
    assert cache.reused == 2
    assert_parsed_as_in_full(cache, data)
    assert cache.reused == 2  # other structure bytes: parsed in full


# -- scalars that change: the kept plan, with those scalars replaced -------------------------


def _group(s: dict[str, Any]) -> dict[str, Any]:
    group: dict[str, Any] = s["optim"]["param_groups"][0]
    return group


SCALARS: dict[str, Callable[[dict[str, Any]], None]] = {
    "learning rate": lambda s: _group(s).update(lr=0.2),
    "float to int": lambda s: _group(s).update(lr=1),
    "to None": lambda s: _group(s).update(lr=None),
    "to str": lambda s: _group(s).update(lr='a "quoted" \\ \u00e9'),
    "to bool": lambda s: _group(s).update(lr=True),
    "negative zero": lambda s: _group(s).update(lr=-0.0),
    "infinity": lambda s: _group(s).update(lr=float("inf")),
    "to bytes": lambda s: _group(s).update(lr=b"\x00\xff"),
    "to complex": lambda s: _group(s).update(lr=1 - 2j),
    "to dtype": lambda s: _group(s).update(lr=torch.bfloat16),
    "large int": lambda s: _group(s).update(lr=2**100),
    "list item": lambda s: _group(s)["params"].__setitem__(3, 99),
    "several": lambda s: (_group(s).update(lr=0.3), _group(s)["params"].__setitem__(49, -1)),
}


@pytest.mark.parametrize("change", list(SCALARS))
def test_a_changed_scalar_is_parsed_with_the_kept_plan_and_reads_as_a_full_parse(change: str) -> None:
    cache, tree = HeaderCache(), state()
    kept = cache.parse(prefix(tree))
    SCALARS[change](tree)
    for step in (2, 3):  # changed, then the same again
        data = prefix(tree, step=step)
        header = cache.parse(data)
        assert header == parse_prefix(data)
        assert header.plan != kept.plan
        assert header.plan.tensors is kept.plan.tensors  # the structure is shared
    assert cache.reused == 2
    data = prefix(state(), step=4)  # and back to the kept values
    assert cache.parse(data) == parse_prefix(data)
    assert cache.reused == 3


def test_a_changed_learning_rate_or_step_count_changes_only_the_scalar_table() -> None:
    tree = state()
    before = prefix(tree, step=1, created=1.5)
    _group(tree).update(lr=0.05)
    _group(tree)["params"][0] = 7
    after = prefix(tree, step=1, created=1.5)
    assert before != after
    assert check_prefix(after).has_structure(check_prefix(before).structure_key())
    (tables_before, doc_before), (tables_after, doc_after) = split(before), split(after)
    assert tables_before == tables_after
    assert {k: v for k, v in doc_before.items() if k != "scalars"} == {
        k: v for k, v in doc_after.items() if k != "scalars"
    }
    assert [doc_before["scalars"][i] for i in (0, 1)] == [0.1, 0]
    assert [doc_after["scalars"][i] for i in (0, 1)] == [0.05, 7]
    assert doc_before["scalars"][2:] == doc_after["scalars"][2:]


def test_the_kept_plan_takes_each_changed_scalar_at_its_own_place() -> None:
    # Scalars everywhere a walk meets them: a dict's values before its attributes, lists,
    # tuples, namedtuples, nested containers between and after them.
    od: Any = collections.OrderedDict(w=torch.zeros(1), v=1)
    od._metadata = {"": {"version": 1}, "x": {"version": 2}}
    base: dict[str, Any] = {"a": {"x": 1, "y": [2, (3, 4)]}, "od": od, "b": 5, "t": (6, torch.ones(1), "s")}
    cache = HeaderCache()
    cache.parse(prefix(base))
    for path in (("a", "x"), ("a", "y", 0), ("b",), ("od", "v")):
        changed = copy.deepcopy(base)
        target = changed
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = "changed"
        data = prefix(changed, step=2)
        assert repr(cache.parse(data)) == repr(parse_prefix(data)), path
    changed = copy.deepcopy(base)
    changed["od"]._metadata["x"]["version"] = 3
    changed["t"] = (6, changed["t"][1], -0.0)
    data = prefix(changed, step=3)
    assert repr(cache.parse(data)) == repr(parse_prefix(data))
    assert cache.reused == 5


def test_the_same_table_bytes_split_into_other_counts_are_another_structure() -> None:
    # One 0-d tensor's record is 16 bytes; so are two dims entries and no tensor.  The
    # same bytes after the counts, the same storages and the same structure document: a
    # kept plan must not take it, a full parse refuses it.
    cache, tree = HeaderCache(), {"s": torch.zeros(())}
    cache.parse(prefix(tree))
    data = prefix(tree, step=2)

    def resplit(header: bytes) -> bytes:
        tensors, dims, storages, structure = struct.unpack_from("<QQQQ", header)
        assert (tensors, dims) == (1, 0)
        return struct.pack("<QQQQ", 0, 2, storages, structure) + header[32:]

    assert_refused_as_in_full(cache, forge(data, resplit))
    assert cache.reused == 0
    for _ in range(2):  # parsed in full and kept again, then re-used
        assert_parsed_as_in_full(cache, data)
    assert cache.reused == 1


def test_a_nan_scalar_is_parsed_with_the_kept_plan() -> None:
    cache, tree = HeaderCache(), state()
    cache.parse(prefix(tree))
    _group(tree).update(lr=float("nan"))
    data = prefix(tree, step=2)
    header, full = cache.parse(data), parse_prefix(data)
    assert cache.reused == 1
    lr = header.plan.root.values[1].values[1].items[0].values[0].value  # type: ignore[union-attr]
    assert lr != lr  # NaN, which == cannot compare: the rest must equal
    assert repr(header.plan) == repr(full.plan)


HOSTILE_SCALARS: dict[str, bytes] = {
    "NaN constant": b"NaN",
    "malformed float": b'["float","nan2"]',
    "malformed bytes": b'["bytes","!!"]',
    "an object": b'{"a":1}',
    "a tensor": b'["tensor",0]',
    "a container": b'["list",[1,2]]',
    "a space after it": b"0.5 ",
    "not JSON": b"0.5.5",
    "an unknown tag": b'["mystery",1]',
}


@pytest.mark.parametrize("case", list(HOSTILE_SCALARS))
def test_a_forged_scalar_over_a_kept_structure_reads_or_raises_as_a_full_parse(case: str) -> None:
    cache, tree = HeaderCache(), state()
    cache.parse(prefix(tree))
    data = prefix(tree, step=2)
    old = b'"scalars":[0.1,'
    assert old in data
    forged = forge(data, lambda h: h.replace(old, b'"scalars":[' + HOSTILE_SCALARS[case] + b",", 1))
    refused: str | None = None
    try:
        full = parse_prefix(forged)
    except astage.IntegrityError as exc:
        refused = str(exc)
    if refused is None:
        assert cache.parse(forged) == full
    else:
        with pytest.raises(astage.IntegrityError) as cached:
            cache.parse(forged)
        assert str(cached.value) == refused
    assert_parsed_as_in_full(cache, data)  # the kept plan is still good
