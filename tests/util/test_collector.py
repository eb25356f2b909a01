"""The one owner of pausing the cyclic collector (astage._util.collector): nesting, threads, and the
program's collector and heap left as astage found them."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from astage import Checkpointer, DefaultStager
from astage._util.collector import gc_paused
from tests.helpers import collections_started


class Node:
    """A tracked object of the program's, young until a collection moves it."""


def generation_of(obj: object) -> int | None:
    """The generation the collector keeps ``obj`` in (None: untracked or frozen)."""
    for generation in range(3):
        if any(o is obj for o in gc.get_objects(generation=generation)):
            return generation
    return None


def many_tensors() -> dict[str, Any]:
    return {f"l{i}": {f"w{j}": torch.randn(4) for j in range(50)} for i in range(40)}  # 2,000


@contextlib.contextmanager
def no_automatic_collection() -> Iterator[None]:
    """Nothing collects inside the block but an explicit call, so where an object sits
    afterwards is decided by what ran, not by when the collector's counts fell due."""
    gc.collect()
    thresholds = gc.get_threshold()
    gc.set_threshold(1 << 30)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


@contextlib.contextmanager
def collector(enabled: bool) -> Iterator[None]:
    """The program's collector, enabled or disabled by the program, as it was afterwards."""
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        yield
    finally:
        (gc.enable if was else gc.disable)()


# -- the pause itself ----------------------------------------------------------------------


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


def test_a_collector_the_program_disabled_stays_disabled_through_nested_pauses() -> None:
    with collector(enabled=False):
        with gc_paused():
            with gc_paused():
                pass
            assert not gc.isenabled()
        assert not gc.isenabled()


def test_a_collector_the_program_enables_during_a_pause_stays_enabled() -> None:
    with collector(enabled=False):
        with gc_paused():
            thread = threading.Thread(target=gc.enable)  # the program, on a thread of its own
            thread.start()
            thread.join()
        assert gc.isenabled()


def test_a_pause_moves_no_object_between_generations() -> None:
    with no_automatic_collection():
        older = Node()
        gc.collect(0)
        young = Node()
        with gc_paused():
            made = Node()
    assert (generation_of(older), generation_of(young), generation_of(made)) == (1, 0, 0)


# -- what a stage, a save and a restore leave to the program -------------------------------


@contextlib.contextmanager
def program_objects_stay_where_they_are() -> Iterator[None]:
    """Check that the block moves none of the program's young objects (one in generation 0,
    one in 1) while nothing collects by itself: without astage, both would stay there.
    astage used to move every young object of the process into the oldest generation
    (``gc.freeze()`` then ``gc.unfreeze()``) after work on 1,000 tensors or more."""
    with no_automatic_collection():
        older = Node()
        gc.collect(0)
        young = Node()
        yield
        assert (generation_of(older), generation_of(young)) == (1, 0)


@pytest.mark.anyio
async def test_first_and_steady_stages_leave_the_program_s_young_objects_young() -> None:
    sd = many_tensors()
    with program_objects_stay_where_they_are():
        async with DefaultStager() as stager:
            await stager.release(await stager.stage(sd))  # a first stage
            await stager.release(await stager.stage(sd))  # a steady one


@pytest.mark.anyio
async def test_saves_and_a_restore_leave_the_program_s_young_objects_young(tmp_path: Path) -> None:
    sd = many_tensors()
    async with DefaultStager() as stager, Checkpointer(tmp_path, stager=stager, keep=2) as ckpt:
        await stager.release(await stager.stage(sd))  # the stages are tested above
        with program_objects_stay_where_they_are():
            for step in range(2):  # the first save keeps its layout, the second re-uses it
                await (await ckpt.save(step, sd)).wait()
        with program_objects_stay_where_they_are():
            restored = await ckpt.restore(1)  # parses the header, decodes the tree
    assert torch.equal(restored["l7"]["w3"], sd["l7"]["w3"])


@pytest.mark.anyio
@pytest.mark.parametrize("enabled", [True, False], ids=["enabled", "disabled-by-the-program"])
async def test_the_program_s_tasks_see_its_own_collector_state_during_a_first_stage(enabled: bool) -> None:
    # The collector is paused inside astage's slices, never across an await: a task of the
    # program that runs between two slices finds the collector as the program left it.
    sd = many_tensors()
    seen: list[bool] = []
    done = anyio.Event()

    async def program() -> None:
        while not done.is_set():
            seen.append(gc.isenabled())
            await anyio.lowlevel.checkpoint()

    with collector(enabled):
        async with DefaultStager() as stager, anyio.create_task_group() as tg:
            tg.start_soon(program)  # runs when the stage first gives the loop a turn
            staged = await stager.stage(sd)
            done.set()
            await stager.release(staged)
        assert gc.isenabled() is enabled
    assert len(seen) >= 2, "the stage ran in several slices, the program between them"
    assert set(seen) == {enabled}


def test_parsing_and_decoding_many_tensors_run_no_collection() -> None:
    # Worker calls pause the collector for their own length: their many short-lived objects
    # start no pass inside them (2-3x the work when they did).
    import numpy as np

    from astage._format.codec import decode, encode, parse_prefix

    state = {f"t{i}": torch.full((2,), float(i)) for i in range(2_000)}
    encoded = encode(state, owner_rank=0, step=0, checkpoint_id="")
    data = bytearray(b"".join(encoded.buffers()))
    with collections_started() as collections:
        header = parse_prefix(data)
        body = torch.from_numpy(np.frombuffer(data, dtype=np.uint8)[header.prefix_nbytes :])
        tree = decode(header, body)
    # None inside either call: at most the young pass that what each left makes due after it.
    assert collections in ([], [0], [0, 0]), collections
    assert torch.equal(tree["t7"], state["t7"])
