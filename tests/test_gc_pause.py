"""The one owner of pausing the cyclic collector (astage._util.collector): nesting, threads, promotion."""

from __future__ import annotations

import gc
import threading

from astage._util.collector import PROMOTE_AT, gc_paused, promote
from tests.helpers import collections_started


class Node:
    """A tracked object that the young generation holds until something moves it."""


def in_generation(obj: object, generation: int) -> bool:
    return any(o is obj for o in gc.get_objects(generation=generation))


def test_pauses_nest_and_the_outermost_end_re_enables() -> None:
    assert gc.isenabled()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_pause_overlapping_another_thread_s_keeps_the_collector_off_until_both_end() -> None:
    entered, leave = threading.Event(), threading.Event()

    def worker() -> None:
        with gc_paused():
            entered.set()
            leave.wait(timeout=10)

    thread = threading.Thread(target=worker)
    thread.start()
    assert entered.wait(timeout=10)
    with gc_paused():
        pass
    assert not gc.isenabled(), "the worker's pause is still on"
    leave.set()
    thread.join()
    assert gc.isenabled()


def test_promotion_moves_young_objects_into_the_oldest_generation_at_the_outermost_end() -> None:
    gc.collect()
    with gc_paused():
        young = Node()
        with gc_paused():
            promote(PROMOTE_AT)
        assert in_generation(young, 0), "promoted only when the outermost pause ends"
    assert in_generation(young, 2)
    assert gc.get_count()[0] < 10


def test_without_a_request_or_outside_a_pause_nothing_is_promoted() -> None:
    gc.collect()
    promote(PROMOTE_AT)  # outside a pause: ignored, and not remembered for the next one
    with gc_paused():
        young = Node()
        promote(PROMOTE_AT - 1)  # too few to be worth it
    assert in_generation(young, 0)


def test_a_collector_the_program_disabled_stays_disabled_and_nothing_is_promoted() -> None:
    gc.disable()
    try:
        with gc_paused():
            young = Node()
            promote(PROMOTE_AT)
        assert not gc.isenabled()
        assert in_generation(young, 0)
    finally:
        gc.enable()


def test_parsing_and_decoding_many_tensors_run_no_collection_and_promote_what_they_made() -> None:
    # A received replica or a restored state lives on: its header's plan and its tree are
    # promoted unwalked, so a full pass does not land on whichever thread allocates next.
    import numpy as np
    import torch

    from astage._format.codec import decode, encode, parse_prefix

    state = {f"t{i}": torch.full((2,), float(i)) for i in range(2 * PROMOTE_AT)}
    encoded = encode(state, owner_rank=0, step=0, checkpoint_id="")
    data = bytearray(b"".join(encoded.buffers()))
    with collections_started() as collections:
        header = parse_prefix(data)
        body = torch.from_numpy(np.frombuffer(data, dtype=np.uint8)[header.prefix_nbytes :])
        tree = decode(header, body)
        after = gc.get_count()[0]
    assert collections == []
    assert after < 50
    assert any(o is tree for o in gc.get_objects(generation=2))
    assert torch.equal(tree["t7"], state["t7"])
