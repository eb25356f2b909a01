"""Run an async function on W local ranks joined in a gloo group on 127.0.0.1, for benchmarks.

The benchmarks ship inside the installed package (``astage bench``), where the test suite's
``tests/distributed.py`` does not exist; this is the part of it a benchmark needs: one
process per rank, a rendezvous store hosted by the parent, results back over a pipe, every
child reaped (killed past ``timeout``).  Nothing here needs the test extra.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import anyio
import torch.distributed as dist


@dataclasses.dataclass
class RankResult:
    """What one rank returned, or why it did not."""

    rank: int
    value: Any = None
    error: str = ""

    def unwrap(self) -> Any:
        """The value, or a ``RuntimeError`` carrying the rank's traceback."""
        if self.error:
            raise RuntimeError(f"rank {self.rank} failed:\n{self.error}")
        return self.value


def run_group(
    world_size: int, target: Callable[..., Awaitable[Any]], *args: Any, timeout: float = 600.0
) -> list[RankResult]:
    """Run ``anyio.run(target, rank, world_size, *args)`` on every rank of a fresh gloo group.

    ``target`` must be a module-level function of an importable module.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "anyio", "astage"])
    # The kernel picks the store's port while binding it: no race for a "free" port.
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False
    )
    results = [RankResult(rank, error="did not report (killed or crashed)") for rank in range(world_size)]
    procs, readers = [], []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child, args=(rank, world_size, store.port, timeout, writer, target, args), daemon=True
            )
            proc.start()
            writer.close()
            procs.append(proc)
            readers.append(reader)
        deadline = time.monotonic() + timeout
        waiting = dict(enumerate(readers))
        while waiting and time.monotonic() < deadline:
            for ready in multiprocessing.connection.wait(list(waiting.values()), timeout=0.1):
                rank = readers.index(ready)
                del waiting[rank]
                with contextlib.suppress(EOFError, OSError):
                    value, error = ready.recv()
                    results[rank] = RankResult(rank, value, error)
        for rank in waiting:
            results[rank].error = f"still running after {timeout} s"
    finally:
        for proc in procs:
            proc.join(timeout=5.0)
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.join(timeout=5.0)
        for reader in readers:
            reader.close()
    return results


def _child(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    conn: multiprocessing.connection.Connection,
    target: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
) -> None:
    report: tuple[Any, str]
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout)
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        try:
            report = (anyio.run(target, rank, world_size, *args), "")
        finally:
            dist.destroy_process_group()
    except BaseException:
        report = (None, traceback.format_exc())
    conn.send(report)
    conn.close()
