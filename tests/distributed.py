"""Run an async function in W real processes joined in a gloo process group on 127.0.0.1.

``run_group(world_size, target, *args)`` starts one process per rank, joins them in a gloo
group on 127.0.0.1 (through a TCP store that the parent hosts), runs
``anyio.run(target, rank, world_size, *args)`` in each and returns one
:class:`RankResult` per rank.  Results and exceptions come back pickled over a pipe per
rank (fine in tests, never in the library).

Children come from a ``forkserver``: a fresh single-threaded interpreter (as safe as
``spawn``: pytest's threads are never forked) that imports torch once for the whole
session, so a group of 4 starts in ~0.5 s instead of paying ~2 s of torch import a rank.

A target may end its own process at a chosen point with :func:`kill_self` (reported as
``killed``) or freeze it with :func:`stop_self` (reported as ``stopped`` once every other
rank is done).  Whatever happens, every child is reaped before ``run_group`` returns: a
child still running at the end (hung, stopped, or past ``timeout``) is SIGKILLed.

``target`` must be a module-level function of an importable module (a test module is
fine): the children import it by name.  Prefer one ``run_group`` per test that runs several
cases (fresh ``dist.new_group`` subgroups isolate cases that break their group), and small
world sizes: the machine may have two cores.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import time
import traceback
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import psutil
import torch
import torch.distributed as dist

Target = Callable[..., Awaitable[Any]]


@dataclass
class RankResult:
    """What one rank's process did.

    :ivar value: the target's return value (``None`` unless ``ok``).
    :ivar error: the exception it raised, or ``None``.
    :ivar traceback: the formatted traceback of ``error`` in the child.
    :ivar exitcode: the process's exit code (negative: the signal that ended it).
    :ivar killed: the process died (e.g. SIGKILL) before reporting a result.
    :ivar stopped: the process was stopped (SIGSTOP) when the others were done.
    :ivar timed_out: the process was still running at ``timeout``.
    """

    rank: int
    value: Any = None
    error: BaseException | None = None
    traceback: str = ""
    exitcode: int | None = None
    killed: bool = False
    stopped: bool = False
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not (self.error or self.killed or self.stopped or self.timed_out)

    def unwrap(self) -> Any:
        """Return the value, or raise an AssertionError that carries the child's traceback."""
        if not self.ok:
            raise AssertionError(f"rank {self.rank} failed: {self.describe()}")
        return self.value

    def describe(self) -> str:
        if self.error is not None:
            return f"{self.error!r}\n{self.traceback}"
        state = (
            "killed"
            if self.killed
            else "stopped"
            if self.stopped
            else "timed out"
            if self.timed_out
            else "ok"
        )
        return f"{state} (exit code {self.exitcode})"


class RemoteError(Exception):
    """Stands for a child's exception that could not be pickled."""


def kill_self() -> None:
    """SIGKILL the calling process: no cleanup, no goodbye, like a crashed rank."""
    os.kill(os.getpid(), signal.SIGKILL)


def stop_self() -> None:
    """SIGSTOP the calling process: a hung rank, whose sockets stay open."""
    os.kill(os.getpid(), signal.SIGSTOP)


def run_group(
    world_size: int,
    target: Target,
    *args: Any,
    timeout: float = 60.0,
    env: Mapping[str, str] | None = None,
    backend: str = "asyncio",
    pg_backend: str = "gloo",
) -> list[RankResult]:
    """Run ``target(rank, world_size, *args)`` on every rank of a fresh group (gloo by default).

    :param timeout: seconds for the whole run; also the process group's own timeout.
    :param env: environment variables set in each child before its group starts (torch
        is already imported there: variables it reads at import time cannot be set so).
    :param backend: the anyio backend the children run ``target`` on.
    :param pg_backend: ``"gloo"``, or ``"nccl"``: rank ``r`` then runs on ``cuda:r``,
        bound to its group with ``device_id``.
    :returns: one result per rank, in rank order.
    """
    ctx = _context()
    # The parent hosts the rendezvous store on a port the kernel picks while binding it:
    # no race with other processes for a "free" port, and it outlives any killed rank.
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )
    procs: list[multiprocessing.process.BaseProcess] = []
    conns: dict[int, multiprocessing.connection.Connection] = {}
    results = [RankResult(rank) for rank in range(world_size)]
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child,
                args=(
                    rank,
                    world_size,
                    store.port,
                    timeout,
                    backend,
                    pg_backend,
                    dict(env or {}),
                    writer,
                    target,
                    args,
                ),
                name=f"rank{rank}",
                daemon=True,
            )
            proc.start()
            writer.close()
            procs.append(proc)
            conns[rank] = reader
        _collect(procs, conns, results, time.monotonic() + timeout)
    finally:
        _reap(procs, [r.stopped or r.timed_out for r in results])
        for conn in conns.values():
            conn.close()
    for result, child in zip(results, procs, strict=True):
        result.exitcode = child.exitcode
    return results


def _context() -> multiprocessing.context.ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "anyio", "astage"])
    return ctx


def _collect(
    procs: list[multiprocessing.process.BaseProcess],
    conns: dict[int, multiprocessing.connection.Connection],
    results: list[RankResult],
    deadline: float,
) -> None:
    waiting = dict(conns)
    rank_of = {id(conn): rank for rank, conn in conns.items()}
    while waiting:
        for ready in multiprocessing.connection.wait(list(waiting.values()), timeout=0.05):
            rank = rank_of[id(ready)]
            conn = waiting.pop(rank)
            try:
                kind, payload, tb = conn.recv()
            except (EOFError, OSError):
                results[rank].killed = True
                continue
            if kind == "ok":
                results[rank].value = payload
            else:
                results[rank].error = _unpickle_error(payload)
                results[rank].traceback = tb
        stopped = [rank for rank in waiting if _is_stopped(procs[rank])]
        if waiting and len(stopped) == len(waiting):
            for rank in stopped:
                results[rank].stopped = True
            return
        if time.monotonic() > deadline:
            for rank in waiting:
                results[rank].timed_out = True
            return


def _reap(procs: list[multiprocessing.process.BaseProcess], doomed: list[bool]) -> None:
    # Stopped and hung children are killed at once; the others exit on their own after
    # destroying their group: give them a moment, then kill whatever is left.
    for proc, kill in zip(procs, doomed, strict=True):
        if kill:
            _kill(proc)
    end = time.monotonic() + 5.0
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            _kill(proc)
            proc.join(timeout=5.0)


def _kill(proc: multiprocessing.process.BaseProcess) -> None:
    if proc.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)


def _is_stopped(proc: multiprocessing.process.BaseProcess) -> bool:
    try:
        return bool(psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED)
    except psutil.Error:
        return False


def _child(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    backend: str,
    pg_backend: str,
    env: dict[str, str],
    conn: multiprocessing.connection.Connection,
    target: Target,
    args: tuple[Any, ...],
) -> None:
    os.environ.update(env)
    report: tuple[str, Any, str]
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout)
        )
        device = torch.device("cuda", rank) if pg_backend == "nccl" else None
        if device is not None:
            torch.cuda.set_device(device)
        dist.init_process_group(
            pg_backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
            device_id=device,
        )
        try:
            value = anyio.run(target, rank, world_size, *args, backend=backend)
        finally:
            dist.destroy_process_group()
        report = ("ok", value, "")
    except BaseException as exc:
        report = ("error", _pickle_error(exc), traceback.format_exc())
    try:
        conn.send(report)
    except Exception as exc:  # an unpicklable value
        conn.send(("error", _pickle_error(exc), traceback.format_exc()))
    conn.close()


def _pickle_error(exc: BaseException) -> bytes:
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
        return blob
    except Exception:
        return pickle.dumps(RemoteError(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"))


def _unpickle_error(blob: bytes) -> BaseException:
    error = pickle.loads(blob)
    assert isinstance(error, BaseException)
    return error


# -- one directory per node, ring holders --------------------------------------------------


def node(root: str, rank: int) -> Path:
    return Path(root) / f"node{rank}"


def holder_of(rank: int, world: int, k: int | None = None) -> int:
    return (rank + (world // 2 if k is None else k)) % world


async def barrier() -> None:
    await anyio.to_thread.run_sync(dist.barrier)


async def lose(root: str, rank: int, *lost: int) -> None:
    await barrier()  # every rank has closed its objects
    if rank in lost:
        shutil.rmtree(node(root, rank))
    await barrier()
