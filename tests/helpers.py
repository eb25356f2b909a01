"""Shared test machinery: a blocked-loop guard, a real tmpfs, cancellation at every task
step, and checks that a stager's released buffers stay untouched.

Cancellation at every await point
    :func:`run_cancelled_at` runs an operation in a fresh task and cancels it right after
    the ``step``-th step of any task it runs (itself and every task it starts), counting
    from 0.  A task's step ends where it suspends, so sweeping ``step`` over 0, 1, 2, ...
    until a run completes cancels the operation once at each of its suspension points, in
    whichever task the point lies.  Under trio the steps are counted by an instrument
    (``after_task_step``); under asyncio, which has no such hook, by a task factory that
    wraps each new task's coroutine and counts its yields.  How many steps an operation
    takes varies a little from run to run (time slices, thread timing): the sweep simply
    goes on until a run completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import sniffio
import torch
from blockbuster import blockbuster_ctx

import astage._staging.copies
from astage import DefaultStager
from astage._files.durable import is_temp_name

# -- the event loop must never block ---------------------------------------------------------


@pytest.fixture(autouse=True)
def no_blocking_calls_on_the_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail any blocking call astage makes on an asyncio loop (blockbuster sees asyncio only).

    Only calls made from astage's own code are checked (``scanned_modules``): the tests'
    own bookkeeping (listing a directory between two runs) is not what is under test.
    Nothing needs allowlisting: astage makes no blocking call on the loop, and torch and
    anyio are reached from it only through calls that do not block.
    """
    if "anyio_backend" in request.fixturenames and request.getfixturevalue("anyio_backend") == "asyncio":
        with blockbuster_ctx("astage"):
            yield
    else:
        yield


# -- a real, small filesystem ------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A real, small tmpfs mounted at ``where`` (root with CAP_SYS_ADMIN only)."""
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        check=False,
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip() or done.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def temp_files(*directories: Path) -> list[Path]:
    """astage temp files anywhere under ``directories``."""
    return [p for d in directories if d.exists() for p in d.rglob("*") if is_temp_name(p.name)]


# -- cancelling at every task step -------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    """How one run of :func:`run_cancelled_at` ended.

    :ivar cancelled: the cancellation was delivered (the operation did not return).
    :ivar value: what the operation returned, when it did.
    :ivar steps: task steps counted during the run.
    """

    cancelled: bool
    value: Any
    steps: int


class _StepCounter:
    def __init__(self, cancel_at: int) -> None:
        self.cancel_at = cancel_at
        self.steps = 0
        self.scope: anyio.CancelScope | None = None

    def step(self) -> None:
        if self.steps == self.cancel_at and self.scope is not None:
            self.scope.cancel()
        self.steps += 1


class _Counted:
    """Await a coroutine, calling ``hook`` each time it suspends (``yield from`` with a hook)."""

    def __init__(self, coro: Coroutine[Any, Any, Any], hook: Callable[[], None]) -> None:
        self._coro = coro
        self._hook = hook

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self._coro
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            # The exception to throw is dropped from this frame before it is thrown: were it
            # still a local here when it propagates, its traceback would hold this frame and
            # the frame the exception, a cycle that pins whatever the operation's frames hold
            # (staged buffers) until the garbage collector runs.
            exc, thrown = thrown, None
            try:
                yielded = coro.send(sent) if exc is None else coro.throw(exc)
            except StopIteration as done:
                return done.value
            finally:
                del exc
            self._hook()
            try:
                sent = yield yielded
            except BaseException as caught:
                sent, thrown = None, caught
                del caught


async def _counted(coro: Coroutine[Any, Any, Any], hook: Callable[[], None]) -> Any:
    return await _Counted(coro, hook)


@contextlib.contextmanager
def _counting_asyncio(counter: _StepCounter) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    previous = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future[Any]:
        wrapped = _counted(coro, counter.step)
        if previous is not None:
            return previous(loop, wrapped, **kwargs)
        return asyncio.Task(wrapped, loop=loop, **kwargs)

    loop.set_task_factory(factory)
    try:
        yield
    finally:
        loop.set_task_factory(previous)


@contextlib.contextmanager
def _counting_trio(counter: _StepCounter, root: list[Any]) -> Iterator[None]:
    import trio
    import trio.abc
    import trio.lowlevel

    class Steps(trio.abc.Instrument):
        def after_task_step(self, task: trio.lowlevel.Task) -> None:
            if root and _descends_from(task, root[0]):
                counter.step()

    instrument = Steps()
    trio.lowlevel.add_instrument(instrument)
    try:
        yield
    finally:
        trio.lowlevel.remove_instrument(instrument)


def _descends_from(task: Any, root: Any) -> bool:
    while task is not None:
        if task is root:
            return True
        nursery = task.parent_nursery
        task = nursery.parent_task if nursery is not None else None
    return False


async def run_cancelled_at(step: int, operation: Callable[[], Awaitable[Any]]) -> Outcome:
    """Run ``operation()`` in a fresh task; cancel it right after task step ``step`` (from 0).

    :returns: whether the cancellation landed, the value otherwise, and the steps counted.
    """
    counter = _StepCounter(step)
    result: list[Any] = []
    root: list[Any] = []

    async def body() -> None:
        if sniffio.current_async_library() == "trio":
            import trio.lowlevel

            root.append(trio.lowlevel.current_task())
        result.append(await operation())

    counting = (
        _counting_trio(counter, root)
        if sniffio.current_async_library() == "trio"
        else _counting_asyncio(counter)
    )
    with counting:
        async with anyio.create_task_group() as tg:
            counter.scope = tg.cancel_scope
            tg.start_soon(body)
    return Outcome(cancelled=not result, value=result[0] if result else None, steps=counter.steps)


async def until(condition: Callable[[], bool], *, seconds: float = 10.0) -> None:
    """Poll ``condition`` every millisecond until it holds.

    :raises TimeoutError: it does not hold within ``seconds``.
    """
    with anyio.fail_after(seconds):
        while not condition():  # noqa: ASYNC110 - the state polled has no event to wait on
            await anyio.sleep(0.001)


# -- a stager's released buffers ----------------------------------------------------------------

POISON = 0xA5
"""The byte written over every released buffer: no source tensor in these tests is all 0xA5."""


# ``free_buffers`` is the one place that reaches into a stager's pool; everything else reads
# ``pool_stats()``: it needs the idle memory itself (a stat counts bytes; a late-write check
# must look at the bytes).


def free_buffers(stager: DefaultStager) -> list[torch.UntypedStorage]:
    """The storages idle in ``stager``'s pool (released, free for the next stage)."""
    return stager._pool.idle_storages()


def _settle(stager: DefaultStager) -> int:
    """``handed_out_bytes`` now (``pool_stats()`` first takes back what nothing references)."""
    return stager.pool_stats().handed_out_bytes


def poison(storages: list[torch.UntypedStorage]) -> None:
    """Fill each storage with :data:`POISON`."""
    for storage in storages:
        torch.empty(0, dtype=torch.uint8).set_(storage).fill_(POISON)


def unpoisoned(storages: list[torch.UntypedStorage]) -> list[int]:
    """Indices of the storages in which some byte is no longer :data:`POISON`."""
    return [
        i
        for i, storage in enumerate(storages)
        if not bool((torch.empty(0, dtype=torch.uint8).set_(storage) == POISON).all())
    ]


async def until_reclaimed(stager: DefaultStager, patience: float = 2.0, *, collect: bool = False) -> float:
    """Wait until no buffer is handed out; the seconds it took.

    :param patience: seconds to wait for the buffers to come back on their own.
    :param collect: once ``patience`` has run out, run the garbage collector and look again:
        buffers held only by reference cycles then count as back.
    :raises AssertionError: buffers are still referenced: by reference cycles only (the
        message says so) or, with ``collect``, by something alive.
    """
    started = time.perf_counter()
    while True:
        if not _settle(stager):
            return time.perf_counter() - started
        if time.perf_counter() - started > patience:
            break
        await anyio.sleep(0.002)
    before = stager.pool_stats()
    gc.collect()
    held = _settle(stager)
    if collect and not held:
        return time.perf_counter() - started
    why = "by reference cycles only" if not held else "by live references"
    raise AssertionError(f"buffers still referenced {patience}s later, {why}: {before}")


def threads_inside(*modules: ModuleType) -> list[str]:
    """Names of the other threads whose stack is in one of ``modules``'s code right now."""
    files = {m.__file__ for m in modules}
    names = {t.ident: t.name for t in threading.enumerate()}
    busy = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        stack = frame
        while stack is not None and stack.f_code.co_filename not in files:
            stack = stack.f_back
        if stack is not None:
            busy.append(names.get(ident, str(ident)))
    return busy


async def quiet(*modules: ModuleType, window: float, seconds: float = 10.0) -> None:
    """Wait until no other thread runs ``modules``'s code, then ``window`` more seconds.

    For checks that something did *not* happen in a worker thread, which no event reports:
    waiting for the threads to leave the code lets a late write of any length land before the
    check, and the window covers work handed to a thread that has not started it yet.
    """
    await until(lambda: not threads_inside(*modules), seconds=seconds)
    await anyio.sleep(window)


async def assert_no_late_writes(stager: DefaultStager, wait: float = 0.05) -> None:
    """Poison every released buffer, let the copying threads finish, and check that nothing
    wrote into one meanwhile."""
    storages = free_buffers(stager)
    poison(storages)
    await quiet(astage._staging.copies, window=wait)
    touched = unpoisoned(storages)
    assert not touched, f"{len(touched)} released buffer(s) were written after their release"


# -- the loop's heartbeat --------------------------------------------------------------------


@dataclass(frozen=True)
class Beats:
    """What a 1 ms heartbeat saw while some work ran.

    A loop blocked by some work shows as a gap as long as the work in ``gaps`` and, unlike
    a stall of the whole process on a loaded machine, in ``busy`` as well.

    :ivar gaps: wall time between consecutive beats.
    :ivar busy: CPU time the loop thread spent between consecutive beats: what kept the
        heartbeat waiting on the loop itself, as opposed to the process being descheduled
        on a loaded machine (which lengthens ``gaps`` but not ``busy``).
    :ivar elapsed: wall time of the whole work.
    """

    gaps: list[float]
    busy: list[float]
    elapsed: float


async def heartbeat_gaps(work: Callable[[], Awaitable[object]], period: float = 0.001) -> Beats:
    """Beats of a heartbeat every ``period`` seconds while ``work()`` runs."""
    gaps: list[float] = []
    busy: list[float] = []
    done = anyio.Event()

    async def beat() -> None:
        last, last_cpu = time.perf_counter(), time.thread_time()
        while not done.is_set():
            await anyio.sleep(period)
            now, now_cpu = time.perf_counter(), time.thread_time()
            gaps.append(now - last)
            busy.append(now_cpu - last_cpu)
            last, last_cpu = now, now_cpu

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(beat)
        await work()
        done.set()
    return Beats(gaps, busy, time.perf_counter() - started)


@contextlib.contextmanager
def collections_started() -> Iterator[list[int]]:
    """The generations of the cyclic collections that start inside the block, which
    begins right after a full one (so no earlier allocation makes one due)."""
    seen: list[int] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.collect()
    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)


# -- the checkpoint file's JSON tree ------------------------------------------------------------


def expand_tensor_runs(node: Any, scalar: Callable[[int], Any] | None = None) -> Any:
    """A JSON tree with its tensor runs written out, as versions 1 to 3 wrote them:
    ``["dict", keys, first]`` becomes ``["dict", keys, [["tensor", first], ...]]``; with
    ``scalar``, each scalar reference (an int) becomes ``scalar(index)``, as versions up to
    5 wrote scalars in the tree."""
    if type(node) is int and scalar is not None:
        return scalar(node)
    if type(node) is not list or not node:
        return node
    tag = node[0]
    if tag in ("dict", "odict"):
        keys, values = node[1], node[2]
        if type(values) is int:
            values = [["tensor", values + k] for k in range(len(keys))]
        else:
            values = [expand_tensor_runs(v, scalar) for v in values]
        attrs = (
            [{name: expand_tensor_runs(v, scalar) for name, v in node[3].items()}] if len(node) == 4 else []
        )
        return [tag, keys, values, *attrs]
    if tag in ("list", "tuple"):
        return [tag, [expand_tensor_runs(v, scalar) for v in node[1]]]
    if tag == "namedtuple":
        return [*node[:3], [expand_tensor_runs(v, scalar) for v in node[3]]]
    return node
