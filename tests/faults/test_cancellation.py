"""Cancellation at every await point of stage, persist, Checkpointer.save and replicate.

Each test sweeps the cancellation point over every task step of one operation
(:func:`tests.helpers.run_cancelled_at`: step 0, 1, 2, ... until a run completes), under
asyncio and trio, and after each cancelled run checks what the operation promises:

* the stager's pool is balanced: nothing leased, and nothing handed out that nobody holds
  (the buffers are back at once; after a cancelled ``replicate``, at the latest once the
  garbage collector has run, see :func:`_rank0`);
* no thread writes into a released buffer: every free buffer is filled with a sentinel
  byte, and the sentinel is still whole a moment later;
* no temp file, no leaked file descriptor, no descriptor written after it was closed;
* the previous durable state is intact (the old replica or checkpoint, or the new one);
* the object is still usable: the next call succeeds and gives the right result.

Under asyncio, any blocking call astage makes on the event loop fails the test
(:func:`tests.helpers.no_blocking_calls_on_the_loop`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import types
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import pytest
import torch
import torch.distributed as dist
from blockbuster import blockbuster_ctx

import astage
import astage._files.durable
from astage._files.durable import replica_path, write_checkpoint_file
from astage._files.reading import load_checkpoint_file_sync
from astage._format.codec import encode
from astage._staging.copies import run_batch
from tests.distributed import run_group
from tests.helpers import (
    assert_no_late_writes,
    no_blocking_calls_on_the_loop,  # noqa: F401 - autouse fixture
    quiet,
    run_cancelled_at,
    temp_files,
    until_reclaimed,
)
from tests.statedicts import assert_same_tree

MAX_POINTS = 2_000
"""A sweep that finds more await points than this is stuck."""


def big_state(seed: int) -> dict[str, Any]:
    """24 MiB over two copy chunks, 500 small tensors (several time slices), an alias."""
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(6 << 20, generator=gen)
    return {
        "big": big,
        "alias": big[5:100],
        "small": {f"k{i}": torch.randn(8, generator=gen) for i in range(500)},
        "step": seed,
    }


def small_state(seed: int, nbytes: int = 256 << 10, tensors: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(nbytes // 4, generator=gen)
    return {
        "weight": weight,
        "head": weight[:8],
        "ids": torch.arange(seed, seed + 4),
        "small": {f"k{i}": torch.randn(4, generator=gen) for i in range(tensors)},
        "step": seed,
    }


def open_fds() -> dict[str, str]:
    """This process's open file descriptors and what they point at."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the descriptor listdir itself used
            continue
    return out


def summary(problems: list[str], shown: int = 8) -> str:
    more = f"\n... and {len(problems) - shown} more" if len(problems) > shown else ""
    return f"{len(problems)} problem(s):\n" + "\n".join(problems[:shown]) + more


@dataclass
class Sweep:
    """Bookkeeping of one sweep: how many points were cancelled, and the problems found."""

    points: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        self.problems.append(f"cancelled at step {self.points}: {text}")

    def check(self) -> None:
        assert not self.problems, summary(self.problems)


class Descriptors:
    """This process's open file descriptors: each change is reported once."""

    def __init__(self) -> None:
        self.known = open_fds()

    def check(self, state: Sweep) -> None:
        now = open_fds()
        if now != self.known:
            opened = {fd: now[fd] for fd in now.keys() - self.known.keys()}
            closed = {fd: self.known[fd] for fd in self.known.keys() - now.keys()}
            state.problem(f"file descriptors changed: opened {opened}, closed {closed}")
            self.known = now


async def sweep(operation: Callable[[], Awaitable[Any]], after: Callable[[Sweep], Awaitable[None]]) -> Any:
    """Cancel ``operation`` at each of its task steps in turn, calling ``after`` each time.

    :returns: the value of the first run that completed.
    """
    state = Sweep()
    while True:
        outcome = await run_cancelled_at(state.points, operation)
        if not outcome.cancelled:
            break
        await after(state)
        state.points += 1
        assert state.points < MAX_POINTS
    print(f"\ncancelled at {state.points} points, then completed")
    state.check()
    assert state.points >= 3, f"only {state.points} await points: is the sweep reaching the operation?"
    return outcome.value


async def check_pool(stager: astage.DefaultStager, state: Sweep) -> None:
    stats = stager.pool_stats()
    if stats.leased_bytes:
        state.problem(f"{stats.leased_bytes} bytes still leased")
    try:
        await until_reclaimed(stager, patience=1.0)
    except AssertionError as exc:
        state.problem(str(exc))
    await assert_no_late_writes(stager)


# -- DefaultStager.stage ------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("lanes", [1, 2])
async def test_stage_cancelled_at_every_await_point(lanes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two lanes: the copy runs in two worker threads at once (astage._staging.copies.copy_lanes), as
    # on a machine with a core to spare; a lane cancelled before its thread started kept
    # its batches, views of the buffers, alive in its frame.
    monkeypatch.setattr(astage._staging.copies, "usable_cores", lambda: lanes + 1)
    sd = big_state(1)
    async with astage.DefaultStager(threads=2) as stager:
        assert stager._lanes == lanes
        fds = Descriptors()

        async def after(state: Sweep) -> None:
            stats = stager.pool_stats()
            # stage() promises every buffer back before it returns: nothing may still hold one.
            if stats.leased_bytes or stats.handed_out_bytes:
                state.problem(f"not balanced when stage() returned: {stats}")
            await check_pool(stager, state)
            fds.check(state)

        staged = await sweep(lambda: stager.stage(sd), after)
        assert_same_tree(staged, sd)
        await stager.release(staged)
        assert_same_tree(await stager.stage(big_state(2)), big_state(2))


@pytest.mark.anyio
async def test_a_stage_cancelled_mid_copy_hands_its_buffers_back_though_the_copy_thread_lingers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The copy thread signals that it stopped, then drops its last batch (views of the
    # staging buffers) when it returns; descheduled in between, it kept the buffers from
    # coming back before stage() returned.  Here it lingers there for sure: until stage()
    # has raised.
    scope = anyio.CancelScope()
    lingered, resumed = threading.Event(), threading.Event()

    def linger(frame: types.FrameType, event: str, arg: object) -> None:
        if event == "return" and frame.f_code is threading.Event.set.__code__:
            sys.setprofile(None)
            lingered.set()
            resumed.wait(30)

    def cancel_then_copy(batch: Any, non_blocking: bool = False) -> None:
        anyio.from_thread.run_sync(scope.cancel)
        sys.setprofile(linger)  # in this copy thread only
        run_batch(batch, non_blocking)

    monkeypatch.setattr("astage._staging.copies.run_batch", cancel_then_copy)
    try:
        async with astage.DefaultStager() as stager:
            with scope:
                await stager.stage(big_state(1))
            assert scope.cancelled_caught
            assert lingered.is_set()
            stats = stager.pool_stats()
            assert stats.leased_bytes == stats.handed_out_bytes == 0, stats
    finally:
        resumed.set()


# -- astage._files.durable.write_checkpoint_file -----------------------------------------------------------


async def assert_no_write_after_close(wait: float = 0.02) -> None:
    """Open sentinel files on the lowest free descriptors (those the writer just closed), let
    the writing threads finish, and check nothing wrote into them: a late ``write`` on a
    reused descriptor would."""
    sentinel = b"sentinel" * 512
    fds = [os.memfd_create("astage-sentinel") for _ in range(8)]
    for fd in fds:
        os.write(fd, sentinel)
    await quiet(astage._files.durable, window=wait)
    try:
        for fd in fds:
            assert os.pread(fd, len(sentinel) + 1, 0) == sentinel, f"descriptor {fd} was written after close"
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.anyio
async def test_write_replica_cancelled_at_every_await_point(tmp_path: Path) -> None:
    path = replica_path(tmp_path / "replicas", owner_rank=0, holder_rank=1)
    old = encode(small_state(1), owner_rank=0, holder_rank=1, step=1, checkpoint_id="old")
    new = encode(small_state(2, 512 << 10), owner_rank=0, holder_rank=1, step=2, checkpoint_id="new")
    versions = {b"".join(old.buffers()): "old", b"".join(new.buffers()): "new"}
    await write_checkpoint_file(path, old)
    fds = Descriptors()
    seen: set[str] = set()

    async def after(state: Sweep) -> None:
        await assert_no_write_after_close()
        if temp_files(path.parent):
            state.problem(f"temp files left: {temp_files(path.parent)}")
        fds.check(state)
        which = versions.get(path.read_bytes())
        if which is None:
            state.problem("the replica is neither the old nor the new one")
        else:
            seen.add(which)
            load_checkpoint_file_sync(path)
        await write_checkpoint_file(path, old)  # usable again, and the next point starts from the old one

    await sweep(lambda: write_checkpoint_file(path, new, chunk_nbytes=64 << 10), after)
    # The sweep ends at the first run that completes: one cancelled in the rename or the
    # directory fsync, which finish whatever happens (a cancelled run never reaches them).
    assert seen == {"old"}
    assert versions[path.read_bytes()] == "new"
    assert_same_tree(load_checkpoint_file_sync(path), small_state(2, 512 << 10))


# -- Checkpointer.save, and the persisting and committing that follow it -----------------------


def step_files(directory: Path) -> dict[str, list[str]]:
    """The files of each step directory, ignoring nothing (temps included)."""
    return {d.name: sorted(os.listdir(d)) for d in sorted(directory.glob("step_*"))}


def committed_or_absent(directory: Path) -> list[str]:
    """Step directories that hold anything but a committed step (data file and marker)."""
    whole = ["rank00000.COMMITTED", "rank00000.astage"]
    return [f"{name}: {files}" for name, files in step_files(directory).items() if files != whole]


@pytest.mark.anyio
async def test_save_cancelled_at_every_await_point(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    async with (
        astage.DefaultStager() as stager,
        astage.Checkpointer(directory, stager=stager, keep=2) as ckpt,
    ):
        step = 0

        async def after(state: Sweep) -> None:
            nonlocal step
            if ckpt.in_flight or step in ckpt.steps():
                state.problem(f"a cancelled save went on: in flight {ckpt.in_flight}, steps {ckpt.steps()}")
            await check_pool(stager, state)
            if temp_files(directory) or committed_or_absent(directory):
                state.problem(f"files left: {step_files(directory)}")
            # The cancelled save has not happened: the same step can be saved again.
            await (await ckpt.save(step, small_state(step, tensors=300))).wait()
            assert_same_tree(await ckpt.restore(step), small_state(step, tensors=300))
            step += 1

        handle = await sweep(lambda: ckpt.save(step, small_state(step, tensors=300)), after)
        await handle.wait()
        assert ckpt.latest() == step
        assert_same_tree(await ckpt.restore(), small_state(step, tensors=300))


@pytest.mark.anyio
async def test_checkpointer_abandoned_at_every_await_point_of_a_save(tmp_path: Path) -> None:
    """Cancel the scope around ``async with Checkpointer`` at every step of opening it,
    saving, persisting, committing, retiring an old step and closing it."""
    directory = tmp_path / "ckpt"
    async with astage.DefaultStager() as stager:
        async with astage.Checkpointer(directory, stager=stager, keep=1) as first:
            await (await first.save(0, small_state(0))).wait()
        step = 1
        fds = Descriptors()
        outcomes: dict[str, int] = {"committed": 0, "not committed": 0}

        async def session() -> None:
            async with astage.Checkpointer(directory, stager=stager, keep=1) as ckpt:
                await (await ckpt.save(step, small_state(step))).wait()

        async def after(state: Sweep) -> None:
            nonlocal step
            await check_pool(stager, state)
            fds.check(state)
            # What the abandoned session left, before a new start sweeps anything.
            if temp_files(directory) or committed_or_absent(directory):
                state.problem(f"files left: {step_files(directory)}")
            async with astage.Checkpointer(directory, stager=stager, keep=1) as fresh:
                latest = fresh.latest()
                if latest not in (step - 1, step):
                    state.problem(f"latest is {latest}, expected {step - 1} or {step}")
                else:
                    assert_same_tree(await fresh.restore(), small_state(latest))
                outcomes["committed" if latest == step else "not committed"] += 1
                if latest != step:  # usable: the abandoned step can be saved now
                    await (await fresh.save(step, small_state(step))).wait()
            step += 1

        await sweep(session, after)
        async with astage.Checkpointer(directory, stager=stager) as ckpt:
            assert ckpt.steps() == [step]
            assert_same_tree(await ckpt.restore(), small_state(step))
        assert outcomes["committed"], outcomes
        assert outcomes["not committed"], outcomes


# -- ReplicationStager.replicate (two gloo ranks) ---------------------------------------------


@contextlib.contextmanager
def loop_guard(backend: str) -> Iterator[None]:
    """:func:`tests.helpers.no_blocking_calls_on_the_loop` for a rank's process."""
    if backend != "asyncio":
        yield
        return
    with blockbuster_ctx("astage"):
        yield


async def enter_and_replicate_target(rank: int, world: int, root: str) -> str:
    with blockbuster_ctx("astage"):
        async with astage.ReplicationStager(storage_dir=Path(root) / f"rank{rank}", timeout=5) as rs:
            await rs.stager.release((await rs.replicate(ring_state(rank, 0), step=0)).staged)
    return "ok"


def test_replication_never_blocks_the_event_loop(tmp_path: Path) -> None:
    for result in run_group(2, enter_and_replicate_target, str(tmp_path), timeout=60):
        assert result.unwrap() == "ok"


REPLICA_CHUNK = 64 << 10
PEER_TIMEOUT = 3.0
PEER_GRACE = 0.2
"""How long rank 1 may take to fail on its own once rank 0 has given up the exchange."""
CANCEL_LATENCY = 1.5
"""Longest a cancelled ``replicate`` may take to return."""


def ring_state(rank: int, step: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    weight = torch.randn(16 << 10, generator=gen)  # 64 KiB: one body chunk
    return {"w": weight, "row": weight[3:9], "ids": torch.arange(rank, rank + 4), "meta": {"rank": rank}}


def held_problem(directory: Path, rank: int) -> str | None:
    """Whether the replica this rank holds of its peer is whole and one the peer sent."""
    peer = 1 - rank
    path = replica_path(directory, owner_rank=peer, holder_rank=rank)
    try:
        info = astage.inspect_checkpoint_file(path)
        assert_same_tree(load_checkpoint_file_sync(path), ring_state(peer, info.step))
    except Exception as exc:
        return f"the held replica is unusable: {exc!r}"
    if temp_files(directory):
        return f"temp files left: {temp_files(directory)}"
    return None


async def _key(store: dist.Store, key: str) -> str:
    """The value of ``key`` once the other rank has set it (``get`` would block the loop)."""
    while True:
        if await anyio.to_thread.run_sync(store.check, [key]):
            return bytes(store.get(key)).decode()
        await anyio.sleep(0.002)


async def _rank0(rs: astage.ReplicationStager, step: int, store: dist.Store, report: dict[str, Any]) -> bool:
    """One point of the sweep on the cancelled rank; whether the sweep is over."""
    stager = rs.stager
    state = ring_state(0, step)
    outcome = await run_cancelled_at(report["point"], lambda: rs.replicate(state, step=step))
    if not outcome.cancelled:
        await stager.release(outcome.value.staged)
        report["status"] = "done"
        store.set(str(step), "done")
        return True
    try:  # a fresh call: refused at once if the exchange was entered, else it pairs with rank 1
        result = await rs.replicate(state, step=step)
    except astage.TransportError as exc:
        report["status"] = "refused"
        if "broke the process group" not in str(exc):
            report["problems"].append(f"unclear refusal: {exc}")
    else:
        report["status"] = "recovered"
        await stager.release(result.staged)
    store.set(str(step), report["status"])
    staged = await stager.stage(state)  # local staging works whatever happened to the group
    assert_same_tree(staged, state)
    await stager.release(staged)
    stats = stager.pool_stats()
    if stats.leased_bytes:
        report["problems"].append(f"{stats.leased_bytes} bytes still leased")
    try:
        # Cancelled tasks' tracebacks are reference cycles under asyncio (anyio keeps each
        # one's exception in a frame of its own): the collector may be needed, but nothing
        # alive may hold a buffer.
        await until_reclaimed(stager, patience=0.05, collect=True)
    except AssertionError as exc:
        report["problems"].append(f"after a {report['status']} cancellation: {exc}")
    await assert_no_late_writes(stager, wait=0.02)
    return False


async def _rank1(rs: astage.ReplicationStager, step: int, store: dist.Store, report: dict[str, Any]) -> bool:
    """Rank 1 replicates normally; once rank 0 reports it gave up the exchange, it must fail
    on its own or be cancelled, and return promptly."""
    times: dict[str, float] = {}

    async def replicate(scope: anyio.CancelScope) -> None:
        try:
            result = await rs.replicate(ring_state(1, step), step=step)
        except astage.AstageError as exc:
            report["status"] = type(exc).__name__
        else:
            report["status"] = "ok"
            await rs.stager.release(result.staged)
        finally:
            times["returned"] = time.monotonic()
            scope.cancel()

    async def give_up(scope: anyio.CancelScope) -> None:
        if await _key(store, str(step)) == "refused":
            await anyio.sleep(PEER_GRACE)
            report["status"] = "left waiting"
            times["cancelled"] = time.monotonic()
            scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(give_up, tg.cancel_scope)
        await replicate(tg.cancel_scope)
    peer = await _key(store, str(step))
    if "cancelled" in times and times["returned"] - times["cancelled"] > CANCEL_LATENCY:
        report["problems"].append(
            f"cancelled while waiting for rank 0, replicate() returned only "
            f"{times['returned'] - times['cancelled']:.1f}s later"
        )
    if peer in ("done", "recovered") and report["status"] != "ok":
        report["problems"].append(f"rank 0 {peer} but rank 1 ended with {report['status']}")
    return peer == "done"


async def replicate_sweep_target(rank: int, world: int, root: str, backend: str) -> dict[str, Any]:
    logging.getLogger("astage").setLevel(logging.ERROR)  # every point breaks a group: quiet
    directory = Path(root) / f"rank{rank}"
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
        dist.broadcast_object_list([store.port], src=0)
    else:
        port: list[Any] = [None]
        dist.broadcast_object_list(port, src=0)
        store = dist.TCPStore("127.0.0.1", port[0], 2, is_master=False, timeout=timedelta(seconds=60))
    with loop_guard(backend):
        stager = astage.DefaultStager()
        async with astage.ReplicationStager(
            dist.new_group([0, 1]), storage_dir=directory, stager=stager, chunk_bytes=REPLICA_CHUNK
        ) as rs:
            await stager.release((await rs.replicate(ring_state(rank, 0), step=0)).staged)
        statuses: dict[str, int] = {}
        problems: list[str] = []
        point = 0
        while True:
            # Every point breaks or may break its group: a fresh subgroup for each, which
            # both ranks must have finished connecting before either can break it.
            group = dist.new_group([0, 1])
            await anyio.to_thread.run_sync(dist.barrier)
            report: dict[str, Any] = {"point": point, "status": None, "problems": []}
            async with astage.ReplicationStager(
                group, storage_dir=directory, stager=stager, timeout=PEER_TIMEOUT, chunk_bytes=REPLICA_CHUNK
            ) as rs:
                run = _rank0 if rank == 0 else _rank1
                over = await run(rs, point + 1, store, report)
            problem = held_problem(directory, rank)
            if problem:
                report["problems"].append(problem)
            problems += [f"point {point} ({report['status']}): {p}" for p in report["problems"]]
            statuses[str(report["status"])] = statuses.get(str(report["status"]), 0) + 1
            await anyio.to_thread.run_sync(dist.barrier)
            if over:
                break
            point += 1
            assert point < MAX_POINTS
        return {"points": point, "statuses": statuses, "problems": problems}


@pytest.mark.parametrize(
    "backend",
    [
        "asyncio",
        "trio",
    ],
)
def test_replicate_cancelled_at_every_await_point(tmp_path: Path, backend: str) -> None:
    """Rank 0 cancels its ``replicate`` at each of its task steps; rank 1 replicates normally.

    Cancelled before the exchange, rank 0 can replicate again (and pairs with rank 1);
    cancelled in it, the group is broken by design: rank 0 then refuses every exchange
    with a clear TransportError, while local staging still works.  Either way: its pool is
    balanced, no released buffer is written, no temp file is left, and each rank holds a
    whole replica of its peer (the previous one or the new one).
    """
    results = run_group(2, replicate_sweep_target, str(tmp_path), backend, timeout=240, backend=backend)
    assert all(r.ok for r in results), "\n".join(f"rank {r.rank}: {r.describe()}" for r in results)
    got, other = (r.value for r in results)
    print(f"\nrank 0 cancelled at {got['points']} points: {got['statuses']}; rank 1: {other['statuses']}")
    assert got["points"] >= 10, got
    assert {"recovered", "refused"} <= set(got["statuses"]), got["statuses"]
    assert not got["problems"], summary(got["problems"])
    assert not other["problems"], summary(other["problems"])
