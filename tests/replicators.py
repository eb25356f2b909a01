"""Replication objects for Checkpointer tests: a peer's replica kept in a directory."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import anyio

import astage
from astage._files.durable import replica_path, write_checkpoint_file
from astage._files.reading import find_replicas
from astage._format.codec import encode


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


class DirectoryReplicator:
    """Keeps this rank's latest replica in ``directory``, as a peer would (one file per owner).

    :ivar gate: when set to an Event, replication waits for it.
    :ivar entered: set as a replication call starts.
    :param fail_steps: steps whose replication raises a :class:`astage.TransportError`.
    """

    def __init__(self, directory: Path, *, rank: int = 0, fail_steps: tuple[int, ...] = ()) -> None:
        self.directory = directory
        self.rank = rank
        self.fail_steps = fail_steps
        self.gate: anyio.Event | None = None
        self.entered = anyio.Event()
        self.calls: list[int] = []

    async def replicate_staged(self, staged: Any, *, step: int, checkpoint_id: str) -> Path:
        self.calls.append(step)
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        if step in self.fail_steps:
            raise astage.TransportError(f"peer went away while replicating step {step}")
        replica = await anyio.to_thread.run_sync(
            functools.partial(
                encode, staged, owner_rank=self.rank, holder_rank=1, step=step, checkpoint_id=checkpoint_id
            )
        )
        return await write_checkpoint_file(
            replica_path(self.directory, owner_rank=self.rank, holder_rank=1), replica
        )


class FetchingReplicator(DirectoryReplicator):
    """A replicator that can also hand back the replica of a step (``fetch_replica``)."""

    async def fetch_replica(self, step: int) -> Path | None:
        found = await anyio.to_thread.run_sync(find_replicas, self.directory)
        return next((r.path for r in found if r.step == step and r.owner_rank == self.rank), None)
