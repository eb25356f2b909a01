"""A header's tree JSON written in time slices is the very text one ``json.dumps`` writes.

``json_text_in_slices`` splits the top levels and wide containers of a tree, and dumps runs of a
list's small items together; the checkpoint file, the kept layout's cut and the holder's
cache all compare texts byte for byte, so any difference would be a different header.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from astage._format.scalars import json_text
from astage._format.tree_encoder import json_text_in_slices
from astage._util.timeslice import drive

LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
)
TREES = st.recursive(
    LEAVES,
    lambda children: (
        st.lists(children, max_size=40) | st.dictionaries(st.text(max_size=6), children, max_size=40)
    ),
    max_leaves=400,
)


@settings(max_examples=200, deadline=None)
@given(TREES)
def test_the_sliced_text_is_the_one_call_text(tree: Any) -> None:
    assert drive(json_text_in_slices(tree)) == json_text(tree)


def _node(n: int) -> list[Any]:
    return ["dict", ["exp_avg", "exp_avg_sq"], n]


def test_a_header_shaped_tree_deep_and_wide_gives_the_same_text() -> None:
    # The shape a header's tree has: nodes of three items, a values list of thousands of
    # them, nested a few state_dict levels down, with wide and narrow lists mixed.
    state = ["dict", list(range(3000)), [_node(2 * i) for i in range(3000)]]
    optim = ["dict", ["state", "groups"], [state, [[1, [2, [3]]]]]]
    tree = ["dict", ["model", "optim"], [["dict", ["w"], [0]], optim]]
    wide_then_deep = [[[[[[["leaf", i]]]]]] for i in range(70)]
    deep = {"a": {"b": {"c": {"d": {"e": {"f": {"g": [1, {"h": None}]}}}}}}}
    dicts = deep | {"x": [{"k": i} for i in range(50)]}
    for value in (tree, wide_then_deep, dicts, {"dtensors": [], "tree": tree}):
        assert drive(json_text_in_slices(value)) == json_text(value)
        assert json.loads(json_text(value)) == value
