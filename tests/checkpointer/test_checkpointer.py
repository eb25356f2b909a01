"""The Checkpointer: real files, real fsync, real failures, real processes killed; no mocks.

The replication object here is a small real implementation of the protocol that keeps a
replica of each save in a second directory, the way a peer rank would.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import logging
import os
import random
import select
import signal
import sys
import threading
import time
import types
import warnings
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import pytest
import torch

import astage
import astage._checkpointer.save_pipeline
import astage._format.codec
from astage._files.durable import (
    is_temp_name,
    replica_path,
    temp_path_for,
    write_checkpoint_file,
)
from tests.distributed import run_group
from tests.helpers import no_blocking_calls_on_the_loop, tmpfs  # noqa: F401 - autouse fixture
from tests.replicators import DirectoryReplicator, FetchingReplicator, flip_last_byte
from tests.statedicts import (
    assert_same_tree,
    bytes_equal,
    model_state,
    rich_state_dict,
    tensors_of,
)

# -- helpers ------------------------------------------------------------------------------


def restorable_rich_state() -> dict[str, Any]:
    """The shared rich state_dict minus what the checkpoint file format cannot hold."""
    state = rich_state_dict()
    # Objects and tensor attributes cannot; a namedtuple comes back as an equal namedtuple
    # of a class rebuilt from its name and fields, not as the same class.
    for key in ("frozen", "slotted", "tagged", "point"):
        del state[key]
    return state


def all_files(directory: Path) -> list[str]:
    """Every file under ``directory``, as sorted relative paths."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def no_temps(*directories: Path) -> bool:
    return not any(is_temp_name(p.name) for d in directories for p in d.rglob("*"))


def step_files(directory: Path, step: int) -> list[str]:
    path = directory / f"step_{step:010d}"
    return sorted(os.listdir(path)) if path.exists() else []


class Progress:
    """An ``on_progress`` callback that records the events and lets a test await one."""

    def __init__(self) -> None:
        self.events: list[astage.SaveEvent] = []
        self._changed = anyio.Event()

    def __call__(self, event: astage.SaveEvent) -> None:
        self.events.append(event)
        self._changed.set()
        self._changed = anyio.Event()

    def kinds(self, step: int) -> list[str]:
        return [e.kind for e in self.events if e.step == step]

    async def reached(self, kind: str, step: int) -> None:
        with anyio.fail_after(10):
            while kind not in self.kinds(step):
                await self._changed.wait()


class SharingReplicator(DirectoryReplicator):
    """A replicator that takes the save's encoded replica (``encoded=``) and writes it
    relabelled, as :class:`astage.ReplicationStager` does; it declares so."""

    accepts_encoded = True

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.received: list[astage._format.codec.Encoded | None] = []

    async def replicate_staged(  # type: ignore[override]
        self,
        staged: Any,
        *,
        step: int,
        checkpoint_id: str,
        encoded: astage._format.codec.Encoded | None = None,
    ) -> Path:
        self.received.append(encoded)
        assert encoded is not None
        replica = await anyio.to_thread.run_sync(
            functools.partial(encoded.relabel, owner_rank=self.rank, holder_rank=1)
        )
        return await write_checkpoint_file(
            replica_path(self.directory, owner_rank=self.rank, holder_rank=1), replica
        )


# -- saving and restoring -----------------------------------------------------------------


@pytest.mark.anyio
async def test_save_returns_once_staged_and_later_changes_never_reach_the_checkpoint(tmp_path: Path) -> None:
    replicator = DirectoryReplicator(tmp_path / "peer")
    replicator.gate = anyio.Event()
    progress = Progress()
    events = progress.events
    state = model_state(1)
    expected = [t.clone() for t in tensors_of(state)]
    async with astage.Checkpointer(tmp_path / "ckpt", replication=replicator, on_progress=progress) as ckpt:
        handle = await ckpt.save(1, state)
        assert not handle.done
        assert ckpt.in_flight == (1,)
        for t in tensors_of(state):  # training goes on at once: the checkpoint must not see it
            t.add_(1)
        assert [e.kind for e in events] == ["staged"]
        await progress.reached("persisted", 1)
        assert ckpt.steps() == [], "not committed while replication is still going on"
        replicator.gate.set()
        stats = await handle.wait()
        assert ckpt.steps() == [1]
        assert not ckpt.in_flight
        restored = await ckpt.restore(1)
    assert all(bytes_equal(a, b) for a, b in zip(tensors_of(restored), expected, strict=True))
    assert not bytes_equal(tensors_of(restored)[0], tensors_of(state)[0])
    assert [e.kind for e in events] == ["staged", "persisted", "replicated", "committed"]
    assert {e.step for e in events} == {1}
    assert {e.checkpoint_id for e in events} == {handle.checkpoint_id}
    assert events[-1].stats == stats == handle.stats == ckpt.last_stats
    assert stats.step == 1
    assert stats.nbytes == (tmp_path / "ckpt" / "step_0000000001" / "rank00000.astage").stat().st_size
    assert 0 < stats.staging_seconds < stats.total_seconds
    assert 0 <= stats.backpressure_seconds <= stats.staging_seconds
    assert stats.persist_seconds > 0
    assert stats.gbps > 0
    assert stats.replicate_seconds is not None
    assert stats.replicate_seconds > 0
    assert stats.stage is not None
    assert stats.stage.bytes > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.nbytes = 0  # type: ignore[misc]


@pytest.mark.anyio
async def test_restore_latest_and_a_given_step_bit_exact(tmp_path: Path) -> None:
    rich = restorable_rich_state()
    async with astage.Checkpointer(tmp_path, keep=None) as ckpt:
        assert ckpt.latest() is None
        await ckpt.save(3, rich)
        for step in (5, 9):
            await ckpt.save(step, model_state(step))
        await ckpt.wait()
        assert ckpt.steps() == [3, 5, 9]
        assert ckpt.latest() == 9
        assert_same_tree(await ckpt.restore(), model_state(9))
        assert_same_tree(await ckpt.restore(3), rich)
    async with astage.Checkpointer(tmp_path, keep=None) as again:
        assert again.steps() == [3, 5, 9]
        assert_same_tree(await again.restore(5), model_state(5))
        assert_same_tree(await again.restore(3), rich)


@pytest.mark.anyio
async def test_a_module_and_optimizer_round_trip_into_fresh_objects(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    async with astage.Checkpointer(tmp_path) as ckpt:
        await ckpt.save(1, {"model": model.state_dict(), "optim": opt.state_dict()})
        await ckpt.wait()
        state = await ckpt.restore()
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert bytes_equal(a, b)
    assert_same_tree(fresh_opt.state_dict()["state"], opt.state_dict()["state"])


# -- back-pressure and ordering ------------------------------------------------------------


class CountingStager(astage.DefaultStager):
    """A real stager that counts the stages it was asked for."""

    stages = 0

    async def stage(self, state_dict: Any) -> Any:
        self.stages += 1
        return await super().stage(state_dict)


@pytest.mark.anyio
@pytest.mark.parametrize("max_in_flight", [1, 2])
async def test_back_pressure_bounds_the_saves_in_flight_and_their_memory(
    tmp_path: Path, max_in_flight: int
) -> None:
    replicator = DirectoryReplicator(tmp_path / "peer")
    replicator.gate = anyio.Event()
    one_state = 256 << 10
    async with CountingStager() as stager:
        async with astage.Checkpointer(
            tmp_path / "ckpt", stager=stager, replication=replicator, max_in_flight=max_in_flight
        ) as ckpt:
            for step in range(max_in_flight):
                with anyio.fail_after(5):
                    await ckpt.save(step, model_state(step, one_state))
            blocked: list[astage.SaveHandle] = []

            async def one_more() -> None:
                blocked.append(await ckpt.save(max_in_flight, model_state(max_in_flight, one_state)))

            async with anyio.create_task_group() as tg:
                tg.start_soon(one_more)
                await anyio.wait_all_tasks_blocked()
                # A save waits for its slot before it stages: this one has not started.
                assert stager.stages == max_in_flight, "a save beyond max_in_flight must wait"
                assert blocked == []
                assert ckpt.in_flight == tuple(range(max_in_flight))
                pool = stager.pool_stats()
                assert pool.handed_out_bytes + pool.leased_bytes <= max_in_flight * (one_state + 64)
                await anyio.sleep(0.2)  # hold the gate: the wait it causes must show in the stats
                replicator.gate.set()
            stats = await blocked[0].wait()
            assert stats.backpressure_seconds > 0.1
            await ckpt.wait()
            assert ckpt.steps() == list(range(max_in_flight + 1))
            assert stager.pool_stats().handed_out_bytes == stager.pool_stats().leased_bytes == 0
        assert not stager.closed, "a stager passed in is not closed by the Checkpointer"


@pytest.mark.anyio
async def test_replication_and_commits_follow_save_order(tmp_path: Path) -> None:
    replicator = DirectoryReplicator(tmp_path / "peer")
    order: list[tuple[str, int]] = []
    sizes = {1: 8 << 20, 2: 4 << 10, 3: 4 << 10}  # the first takes longest to write
    async with astage.Checkpointer(
        tmp_path / "ckpt",
        replication=replicator,
        max_in_flight=3,
        on_progress=lambda e: order.append((e.kind, e.step)),
    ) as ckpt:
        for step, nbytes in sizes.items():
            await ckpt.save(step, model_state(step, nbytes))
        await ckpt.wait()
    assert replicator.calls == [1, 2, 3]
    assert [step for kind, step in order if kind == "committed"] == [1, 2, 3]


# -- the commit protocol ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_marker_is_written_last_and_describes_the_files(tmp_path: Path) -> None:
    replicator = DirectoryReplicator(tmp_path / "peer")
    replicator.gate = anyio.Event()
    directory = tmp_path / "ckpt"
    progress = Progress()
    async with astage.Checkpointer(directory, replication=replicator, rank=7, on_progress=progress) as ckpt:
        handle = await ckpt.save(42, model_state(42))
        await progress.reached("persisted", 42)
        assert step_files(directory, 42) == ["rank00007.astage"], "durable data, no marker yet"
        assert ckpt.steps() == []
        assert ckpt.latest() is None
        replicator.gate.set()
        await handle.wait()
        assert step_files(directory, 42) == ["rank00007.COMMITTED", "rank00007.astage"]
    marker = json.loads((directory / "step_0000000042" / "rank00007.COMMITTED").read_text())
    assert (marker["format"], marker["version"]) == ("astage-checkpoint", 2)
    assert isinstance(marker.pop("crc32c"), int)
    assert (marker["step"], marker["rank"], marker["checkpoint_id"]) == (42, 7, handle.checkpoint_id)
    assert isinstance(marker["created"], float)
    assert abs(marker["created"] - time.time()) < 60
    (entry,) = marker["files"]
    assert entry["name"] == "rank00007.astage"
    assert entry["nbytes"] == (directory / "step_0000000042" / "rank00007.astage").stat().st_size
    assert isinstance(entry["storages_crc32c"], int)
    assert no_temps(tmp_path)


@pytest.mark.anyio
async def test_a_step_without_its_marker_is_invisible_and_swept_at_start(tmp_path: Path) -> None:
    async with astage.Checkpointer(tmp_path, keep=None) as ckpt:
        for step in (1, 2):
            await ckpt.save(step, model_state(step))
        await ckpt.wait()
    # What crashed runs leave: a marker never written, temps, a step never finished.
    (tmp_path / "step_0000000002" / "rank00000.COMMITTED").unlink()
    stale = [
        temp_path_for(tmp_path / "step_0000000001" / "rank00000.COMMITTED"),
        temp_path_for(tmp_path / "step_0000000003" / "rank00000.astage"),
    ]
    stale[1].parent.mkdir()
    for path in stale:
        path.write_bytes(b"partial")
    # What is not ours must survive: other ranks' files and temps, foreign names.
    foreign = [
        tmp_path / "step_0000000002" / "rank00001.astage",
        temp_path_for(tmp_path / "step_0000000003" / "rank00001.astage"),
        tmp_path / "step_0000000001" / "notes.txt",
        tmp_path / "step_12" / "rank00000.astage",
        tmp_path / "unrelated.astage",
    ]
    for path in foreign:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"not ours")
    async with astage.Checkpointer(tmp_path, keep=None) as ckpt:
        assert ckpt.steps() == [1]
        assert ckpt.latest() == 1
        assert_same_tree(await ckpt.restore(), model_state(1))
        with pytest.raises(astage.ResourceError, match="step 2 of rank 0 is not committed"):
            await ckpt.restore(2)
    assert all(path.exists() for path in foreign)
    assert not any(path.exists() for path in stale)
    assert step_files(tmp_path, 2) == ["rank00001.astage"]
    assert step_files(tmp_path, 3) == [foreign[1].name]


@pytest.mark.anyio
async def test_a_tampered_or_missing_local_file_falls_back_to_a_replica(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    peer = tmp_path / "peer"
    directory = tmp_path / "ckpt"
    async with astage.Checkpointer(
        directory, replication=DirectoryReplicator(peer), fallback_dirs=[peer], keep=None
    ) as ckpt:
        for step in (1, 2):
            await ckpt.save(step, model_state(step))
        await ckpt.wait()
        flip_last_byte(directory / "step_0000000002" / "rank00000.astage")
        with caplog.at_level(logging.WARNING, logger="astage.checkpointer"):
            assert_same_tree(await ckpt.restore(), model_state(2))
        assert "checksum mismatch" in caplog.text
        assert "restored step 2 of rank 0 from the replica" in caplog.text
        # The peer keeps only the newest replica: step 1 has no fallback.
        flip_last_byte(directory / "step_0000000001" / "rank00000.astage")
        with pytest.raises(astage.IntegrityError, match="cannot restore step 1") as info:
            await ckpt.restore(1)
        assert "checksum mismatch" in str(info.value)
        (directory / "step_0000000002" / "rank00000.astage").unlink()
        assert_same_tree(await ckpt.restore(2), model_state(2))


@pytest.mark.anyio
async def test_the_replication_object_can_supply_the_replica(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    replicator = FetchingReplicator(tmp_path / "peer", rank=3)
    async with astage.Checkpointer(directory, replication=replicator, rank=3) as ckpt:
        await ckpt.save(5, model_state(5))
        await ckpt.wait()
        (directory / "step_0000000005" / "rank00003.astage").write_bytes(b"")
        assert_same_tree(await ckpt.restore(), model_state(5))


@pytest.mark.anyio
async def test_replicas_of_another_rank_step_or_checkpoint_are_never_used(tmp_path: Path) -> None:
    peer = tmp_path / "peer"
    directory = tmp_path / "ckpt"
    async with astage.Checkpointer(directory, fallback_dirs=[peer]) as ckpt:
        await ckpt.save(2, model_state(2))
        await ckpt.wait()
        # Same step, other rank; same rank, other step; same rank and step, another run.
        await DirectoryReplicator(peer, rank=1).replicate_staged(model_state(2), step=2, checkpoint_id="x")
        other = peer / "other"
        await DirectoryReplicator(other, rank=0).replicate_staged(model_state(3), step=3, checkpoint_id="y")
        await DirectoryReplicator(peer, rank=0).replicate_staged(model_state(4), step=2, checkpoint_id="z")
        (directory / "step_0000000002" / "rank00000.astage").unlink()
        with pytest.raises(astage.IntegrityError, match="the commit marker names"):
            await ckpt.restore(2)
        with pytest.raises(astage.ResourceError, match="no replica of it was found"):
            await ckpt.restore(3)
    async with astage.Checkpointer(tmp_path / "empty") as empty:
        with pytest.raises(astage.ResourceError, match="no committed checkpoint"):
            await empty.restore()


@pytest.mark.anyio
async def test_without_replicas_a_tampered_checkpoint_is_an_integrity_error(tmp_path: Path) -> None:
    async with astage.Checkpointer(tmp_path) as ckpt:
        await ckpt.save(1, model_state(1))
        await ckpt.wait()
        path = tmp_path / "step_0000000001" / "rank00000.astage"
        good = path.read_bytes()
        for damaged in (good[:-1], good + b"\x00", good[:100]):
            path.write_bytes(damaged)
            with pytest.raises(astage.IntegrityError, match="step 1"):
                await ckpt.restore()
        path.write_bytes(good)
        assert_same_tree(await ckpt.restore(), model_state(1))


async def replicated_ranks(rank: int, world: int, root: str) -> list[int]:
    """Two ranks sharing a checkpoint directory, each replicating to the other over gloo."""
    base = Path(root)
    async with (
        astage.ReplicationStager(storage_dir=base / f"replicas{rank}", timeout=30) as replication,
        astage.Checkpointer(
            base / "ckpt",
            rank=rank,
            replication=replication,
            max_in_flight=2,
            keep=2,
            fallback_dirs=[base / f"replicas{(rank + 1) % world}"],  # where the peer keeps ours
        ) as ckpt,
    ):
        for step in (1, 2, 3):
            await ckpt.save(step, model_state(10 * step + rank))
        await ckpt.wait()
        if rank == 0:  # losing the local copy: the peer's durable replica brings it back
            (ckpt.step_dir(3) / "rank00000.astage").unlink()
            assert_same_tree(await ckpt.restore(), model_state(30))
        return ckpt.steps()


def test_with_a_replication_stager_each_rank_can_restore_from_its_peer(tmp_path: Path) -> None:
    results = run_group(2, replicated_ranks, str(tmp_path), timeout=60)
    assert [r.unwrap() for r in results] == [[2, 3], [2, 3]]


# -- retention --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_retention_keeps_the_newest_and_deletes_only_after_a_newer_commit(tmp_path: Path) -> None:
    replicator = DirectoryReplicator(tmp_path / "peer")
    directory = tmp_path / "ckpt"
    async with astage.Checkpointer(directory, keep=2, replication=replicator) as ckpt:
        for step in (10, 20):
            await ckpt.save(step, model_state(step))
        await ckpt.wait()
        replicator.gate, replicator.entered = anyio.Event(), anyio.Event()
        handle = await ckpt.save(30, model_state(30))
        with anyio.fail_after(10):
            await replicator.entered.wait()
        assert ckpt.steps() == [10, 20]
        assert step_files(directory, 10) == ["rank00000.COMMITTED", "rank00000.astage"]
        replicator.gate.set()
        await handle.wait()
        assert ckpt.steps() == [20, 30]
        assert not (directory / "step_0000000010").exists()
        # A failed newer save deletes nothing.
        replicator.gate, replicator.fail_steps = None, (40,)
        await ckpt.save(40, model_state(40))
        with pytest.raises(astage.PersistError, match="step 40"):
            await ckpt.wait()
        assert ckpt.steps() == [20, 30]
        # Going back to an older step (a rollback) never deletes the step just saved.
        await ckpt.save(25, model_state(25))
        await ckpt.wait()
        assert ckpt.steps() == [25, 30]
    assert sorted(p.name for p in directory.iterdir()) == [
        ".astage-rank00000.lock",
        *[f"step_{s:010d}" for s in (25, 30)],
    ]
    async with astage.Checkpointer(directory, keep=None) as ckpt:
        for step in range(5):
            await ckpt.save(step, model_state(step, 1024))
        await ckpt.wait()
        assert ckpt.steps() == [0, 1, 2, 3, 4, 25, 30]


@pytest.mark.anyio
async def test_ranks_sharing_a_directory_keep_to_their_own_files(tmp_path: Path) -> None:
    async with astage.Checkpointer(tmp_path, rank=0, keep=1) as rank0:
        async with astage.Checkpointer(tmp_path, rank=1, keep=1) as rank1:
            for step in (1, 2):
                await rank1.save(step, model_state(step + 100))
                await rank1.wait()
                await rank0.save(step, model_state(step))
                await rank0.wait()
            await rank1.save(3, model_state(103))
            await rank1.wait()
            assert (rank0.steps(), rank1.steps()) == ([2], [3])
            assert step_files(tmp_path, 2) == ["rank00000.COMMITTED", "rank00000.astage"]
            assert_same_tree(await rank1.restore(), model_state(103))
        with pytest.raises(astage.ResourceError, match="in use by another Checkpointer for rank 0"):
            async with astage.Checkpointer(tmp_path, rank=0):
                pass
    async with astage.Checkpointer(tmp_path, rank=1) as rank1:
        assert rank1.steps() == [3]


# -- failures ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_failed_write_is_reported_names_the_step_and_commits_nothing(tmp_path: Path) -> None:
    events: list[astage.SaveEvent] = []
    replicator = DirectoryReplicator(tmp_path / "peer")
    async with astage.Checkpointer(
        tmp_path, on_progress=events.append, keep=None, replication=replicator
    ) as ckpt:
        await ckpt.save(1, model_state(1))
        (tmp_path / "step_0000000002").write_bytes(b"a file where the step directory goes")
        handle = await ckpt.save(2, model_state(2))
        with pytest.raises(astage.PersistError, match="step 2 failed and was not committed") as info:
            await ckpt.wait()
        assert isinstance(info.value.__cause__, astage.PersistError)
        assert isinstance(info.value.__cause__.__cause__, OSError)
        with pytest.raises(astage.PersistError, match="step 2"):
            await handle.wait()
        await ckpt.wait()  # reported once
        assert ckpt.steps() == [1]
        failed = [e for e in events if e.kind == "failed"]
        assert [e.step for e in failed] == [2]
        assert failed[0].error is info.value
        assert replicator.calls == [1, 2], "replication stays in step with the other ranks"
        (tmp_path / "step_0000000002").unlink()
        await ckpt.save(2, model_state(2))
        await ckpt.wait()
        assert ckpt.steps() == [1, 2]
    assert no_temps(tmp_path)


@pytest.mark.anyio
async def test_a_failure_is_raised_by_the_next_save_which_saves_nothing(tmp_path: Path) -> None:
    progress = Progress()
    replicator = DirectoryReplicator(tmp_path / "peer", fail_steps=(1,))
    async with astage.Checkpointer(tmp_path / "ckpt", on_progress=progress, replication=replicator) as ckpt:
        await ckpt.save(1, model_state(1))
        await progress.reached("failed", 1)
        with pytest.raises(astage.PersistError, match="step 1 failed") as info:
            await ckpt.save(2, model_state(2))
        assert isinstance(info.value.__cause__, astage.TransportError)
        assert ckpt.steps() == []
        await ckpt.save(2, model_state(2))
        await ckpt.wait()
        assert ckpt.steps() == [2]
    assert all_files(tmp_path / "ckpt") == [
        ".astage-rank00000.lock",
        "step_0000000002/rank00000.COMMITTED",
        "step_0000000002/rank00000.astage",
    ]


@pytest.mark.anyio
async def test_a_replication_failure_fails_the_save_and_removes_its_files(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    replicator = DirectoryReplicator(tmp_path / "peer", fail_steps=(2, 3))
    async with astage.Checkpointer(directory, replication=replicator, max_in_flight=2) as ckpt:
        await ckpt.save(1, model_state(1))
        await ckpt.save(2, model_state(2))
        await ckpt.save(3, model_state(3))
        with pytest.raises(astage.PersistError, match=r"step 2 failed .*\(also failed: step 3\)") as info:
            await ckpt.wait()
        assert isinstance(info.value.__cause__, astage.PersistError)
        assert isinstance(info.value.__cause__.__cause__, astage.TransportError)
        assert ckpt.steps() == [1]
        assert not (directory / "step_0000000002").exists()
        await ckpt.save(4, model_state(4))
    assert sorted(p.name for p in directory.iterdir()) == [
        ".astage-rank00000.lock",
        "step_0000000001",
        "step_0000000004",
    ]


@pytest.mark.anyio
async def test_leaving_the_block_raises_an_unreported_failure_after_closing(tmp_path: Path) -> None:
    replicator = DirectoryReplicator(tmp_path / "peer", fail_steps=(1,))
    stager = astage.DefaultStager()
    ckpt = astage.Checkpointer(tmp_path / "ckpt", replication=replicator, stager=stager)
    with pytest.raises(astage.PersistError, match="step 1"):
        async with ckpt:
            await ckpt.save(1, model_state(1))
    assert ckpt.closed
    await ckpt.aclose()
    assert stager.pool_stats().handed_out_bytes == 0
    await stager.aclose()


@pytest.mark.anyio
async def test_an_error_in_the_block_still_lets_in_flight_saves_commit(tmp_path: Path) -> None:
    async def train() -> None:
        async with astage.Checkpointer(tmp_path) as ckpt:
            await ckpt.save(1, model_state(1))
            raise ValueError("training diverged")

    with pytest.raises(ValueError, match="training diverged"):
        await train()
    async with astage.Checkpointer(tmp_path) as ckpt:
        assert ckpt.steps() == [1]


@pytest.mark.anyio
async def test_a_read_only_filesystem_fails_the_save_cleanly(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "8m") as mnt:
        async with astage.Checkpointer(mnt) as ckpt:
            await ckpt.save(1, model_state(1))
            await ckpt.wait()
            await anyio.run_process(["mount", "-o", "remount,ro", str(mnt)])
            await ckpt.save(2, model_state(2))
            with pytest.raises(astage.PersistError, match="step 2") as info:
                await ckpt.wait()
            assert "Read-only file system" in str(info.value)
            assert ckpt.steps() == [1]
            assert_same_tree(await ckpt.restore(), model_state(1))
            await anyio.run_process(["mount", "-o", "remount,rw", str(mnt)])
            await ckpt.save(3, model_state(3))
            await ckpt.wait()
            assert ckpt.steps() == [1, 3]
        assert no_temps(mnt)


@pytest.mark.anyio
async def test_a_full_disk_fails_the_save_and_keeps_the_older_checkpoints(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        async with astage.Checkpointer(mnt, keep=1) as ckpt:
            await ckpt.save(1, model_state(1, 256 << 10))
            await ckpt.save(2, model_state(2, 2 << 20))
            with pytest.raises(astage.PersistError, match="step 2"):
                await ckpt.wait()
            assert ckpt.steps() == [1]
            assert_same_tree(await ckpt.restore(), model_state(1, 256 << 10))
        assert all_files(mnt) == [
            ".astage-rank00000.lock",
            "step_0000000001/rank00000.COMMITTED",
            "step_0000000001/rank00000.astage",
        ]


# -- cancellation ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_cancelling_save_at_each_await_point_leaks_nothing(tmp_path: Path) -> None:
    state = {"big": torch.randn(1 << 20), "small": {f"k{i}": torch.randn(8) for i in range(200)}}
    async with (
        astage.DefaultStager() as stager,
        astage.Checkpointer(tmp_path, stager=stager, keep=None) as ckpt,
    ):
        points = 0
        while True:
            result: list[astage.SaveHandle] = []

            async def save(out: list[astage.SaveHandle] = result) -> None:
                out.append(await ckpt.save(1, state))

            async with anyio.create_task_group() as tg:
                tg.start_soon(save)
                for _ in range(points):  # let save() pass `points` await points, then cancel
                    await anyio.lowlevel.checkpoint()
                tg.cancel_scope.cancel()
            await ckpt.wait()
            stats = stager.pool_stats()
            assert stats.leased_bytes == 0, f"leak when cancelled at {points}"
            assert no_temps(tmp_path)
            if result:
                break
            assert stats.handed_out_bytes == 0, f"leak when cancelled at {points}"
            assert (ckpt.steps(), ckpt.in_flight) == ([], ())
            assert all_files(tmp_path) == [".astage-rank00000.lock"]
            points += 1
            assert points < 10_000
        assert points > 3, "save() should have several await points"
        assert ckpt.steps() == [1]
        assert_same_tree(await ckpt.restore(), state)
        # The committed save gave its copy back: the next save allocates nothing.  (The
        # tracebacks of the cancelled stages above are reference cycles that can pin a reused
        # buffer until the collector runs: collect first.)
        gc.collect()
        again = await (await ckpt.save(2, state)).wait()
        assert again.stage is not None
        assert again.stage.bytes_allocated == 0


@pytest.mark.anyio
async def test_cancelling_a_save_waiting_for_room_stages_nothing(tmp_path: Path) -> None:
    replicator = DirectoryReplicator(tmp_path / "peer")
    replicator.gate = anyio.Event()
    async with (
        astage.DefaultStager() as stager,
        astage.Checkpointer(tmp_path / "ckpt", stager=stager, replication=replicator) as ckpt,
    ):
        await ckpt.save(1, model_state(1))
        held = stager.pool_stats().handed_out_bytes
        with anyio.move_on_after(0.05) as scope:
            await ckpt.save(2, model_state(2))
        assert scope.cancelled_caught
        assert stager.pool_stats().handed_out_bytes == held
        replicator.gate.set()
        await ckpt.wait()
        assert ckpt.steps() == [1]
        await ckpt.save(2, model_state(2))  # the step can be saved again
        await ckpt.wait()
        assert ckpt.steps() == [1, 2]


@pytest.mark.anyio
async def test_cancelling_the_scope_around_the_checkpointer_abandons_in_flight_saves(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "ckpt"
    replicator = DirectoryReplicator(tmp_path / "peer")
    async with astage.DefaultStager() as stager:
        async with astage.Checkpointer(directory, stager=stager) as ckpt:
            await ckpt.save(1, model_state(1))
        for delay in (0.0, 0.001, 0.01):
            replicator.gate = anyio.Event()  # never set: the save cannot commit
            with anyio.CancelScope() as scope:
                async with astage.Checkpointer(directory, stager=stager, replication=replicator) as ckpt:
                    handle = await ckpt.save(2, model_state(2, 1 << 20))
                    await anyio.sleep(delay)
                    scope.cancel()
            assert ckpt.closed
            with pytest.raises(astage.PersistError, match="abandoned"):
                await handle.wait()
            assert stager.pool_stats().handed_out_bytes == stager.pool_stats().leased_bytes == 0
            assert no_temps(directory)
            assert all_files(directory) == [
                ".astage-rank00000.lock",
                "step_0000000001/rank00000.COMMITTED",
                "step_0000000001/rank00000.astage",
            ]
        async with astage.Checkpointer(directory, stager=stager) as ckpt:
            assert ckpt.steps() == [1]


@pytest.mark.anyio
@pytest.mark.parametrize(
    "call", ["astage._format.codec.FileLayout.encode", "astage._files.durable._write_all"]
)
async def test_a_save_cancelled_as_a_thread_call_returns_hands_its_buffers_back_though_the_thread_lingers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, anyio_backend: str
) -> None:
    # A worker thread wakes the loop with its result before it drops its own references to
    # the call (its result: the encoded replica; its arguments: views to write): descheduled
    # there, it kept the staged buffers while the cancelled save released its copy, and they
    # stayed "handed out" after the Checkpointer closed (1 run in 5).  Here the thread
    # lingers there for sure: until the stager's release() has returned.  A save runs in a
    # thread of its own, which tells the loop it has ended (and lingers there) only after
    # the save was abandoned: the call waits until the loop has marked it so.
    scope = anyio.CancelScope()
    cancelling, lingered, released = threading.Event(), threading.Event(), threading.Event()
    abandoned = threading.Event()

    def linger(frame: types.FrameType, event: str, arg: object) -> None:
        # The return from the call that hands the save's end to the loop: trio's
        # run_sync_soon, or asyncio's call_soon_threadsafe (not a progress report on the way).
        if event == "return" and frame.f_code.co_name in ("run_sync_soon", "call_soon_threadsafe"):
            outer: types.FrameType | None = frame
            while outer is not None and outer.f_code.co_name != "_chain":
                outer = outer.f_back
            if outer is None:
                sys.setprofile(None)
                lingered.set()
                released.wait(30)

    real_abandon = astage._checkpointer.save_pipeline.Persister.abandon

    def abandon(self: Any, job: Any) -> None:
        real_abandon(self, job)
        abandoned.set()

    monkeypatch.setattr(astage._checkpointer.save_pipeline.Persister, "abandon", abandon)
    real = functools.reduce(getattr, call.split(".")[1:], astage)
    loop = anyio.lowlevel.current_token()

    def call_then_cancel(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        if not cancelling.is_set():  # the save is abandoned as this call returns
            cancelling.set()
            anyio.from_thread.run_sync(scope.cancel, token=loop)
            assert abandoned.wait(30)
            sys.setprofile(linger)  # in this worker thread only
        return result

    class ReleaseObserved(astage.DefaultStager):
        async def release(self, staged: Any) -> None:
            await super().release(staged)
            released.set()

    monkeypatch.setattr(call, call_then_cancel)
    directory = tmp_path / "ckpt"
    try:
        async with ReleaseObserved() as stager:
            with scope:
                async with astage.Checkpointer(directory, stager=stager) as ckpt:
                    handle = await ckpt.save(1, model_state(1, 1 << 20))
                    await anyio.sleep_forever()  # until call_then_cancel cancels the scope
            assert ckpt.closed
            assert lingered.is_set()
            with pytest.raises(astage.PersistError, match="abandoned"):
                await handle.wait()
            assert stager.pool_stats().handed_out_bytes == stager.pool_stats().leased_bytes == 0
    finally:
        released.set()
    assert all_files(directory) == [".astage-rank00000.lock"]


# -- crash consistency --------------------------------------------------------------------


def crash_state(step: int) -> dict[str, Any]:
    return model_state(step, 512 << 10)


def _save_forever(directory: Path, committed: int | None = None) -> None:
    """Save step after step; with ``committed`` (a pipe's write end), tell the parent there
    once the first save has committed."""

    async def main() -> None:
        async with astage.Checkpointer(directory, keep=2, max_in_flight=2) as ckpt:
            step = (ckpt.latest() or 0) + 1
            if committed is not None:
                await (await ckpt.save(step, crash_state(step))).wait()
                os.write(committed, b"c")
                step += 1
            while True:
                await ckpt.save(step, crash_state(step))
                step += 1

    anyio.run(main)


async def _check_after_crash(directory: Path) -> int | None:
    async with astage.Checkpointer(directory, keep=2) as ckpt:
        latest = ckpt.latest()
        if latest is not None:
            assert_same_tree(await ckpt.restore(), crash_state(latest))
            # keep=2, plus up to max_in_flight=2 committed just before the kill, before
            # retention ran for them, plus one whose retention was running after its save
            # freed its slot (a save's thread commits while the loop keeps the books)
            assert len(ckpt.steps()) <= 5
    names = all_files(directory)
    assert no_temps(directory), names
    assert all(
        n == ".astage-rank00000.lock" or n.endswith(("/rank00000.COMMITTED", "/rank00000.astage"))
        for n in names
    )
    return latest


def test_a_writer_killed_at_random_points_always_leaves_a_loadable_latest(tmp_path: Path) -> None:
    rng = random.Random(2024)
    kills = 10 * int(os.environ.get("ASTAGE_SOAK_SCALE", "1"))
    seen: list[int | None] = []
    for i in range(kills):
        last = i == kills - 1  # at least once, let a commit happen first (load can slow the child)
        told, tell = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads, 3.12+
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns into pytest
            try:
                os.close(told)
                torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork
                _save_forever(tmp_path, tell if last else None)
            finally:
                os._exit(0)
        os.close(tell)
        try:
            time.sleep(rng.uniform(0.01, 0.15))  # a random point of the writer's work to kill it at
            if last:
                ready, _, _ = select.select([told], [], [], 30)  # the child's word: committed
                assert ready, "the writer committed nothing in 30 s"
        finally:  # whatever fails here, no writer is left running after the test
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(told)
        seen.append(anyio.run(_check_after_crash, tmp_path))
    latest = [s for s in seen if s is not None]
    assert latest == sorted(latest), "a committed step never goes away"
    assert latest, f"nothing was ever committed: {seen}"


# -- arguments and lifecycle ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep": 0},
        {"keep": -1},
        {"keep": 1.5},
        {"max_in_flight": 0},
        {"rank": -1},
        {"rank": 1 << 31},
        {"threads": 0},
        {"replication": object()},
        {"on_progress": 3},
    ],
)
def test_bad_arguments_are_configuration_errors(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(astage.ConfigurationError):
        astage.Checkpointer(tmp_path, **kwargs)


@pytest.mark.anyio
async def test_bad_steps_and_paths_are_refused_clearly(tmp_path: Path) -> None:
    replicator = DirectoryReplicator(tmp_path / "peer")
    replicator.gate = anyio.Event()
    async with astage.Checkpointer(tmp_path / "ckpt", replication=replicator) as ckpt:
        for step in (-1, True, 1.0, "3", 1 << 63):
            with pytest.raises(astage.ConfigurationError, match="step must be an int"):
                await ckpt.save(step, model_state(1))  # type: ignore[arg-type]
        await ckpt.save(1, model_state(1))
        with pytest.raises(astage.ConfigurationError, match="step 1 is already being saved"):
            await ckpt.save(1, model_state(1))
        replicator.gate.set()
        await ckpt.wait()
        with pytest.raises(astage.ConfigurationError, match="step 1 is already committed"):
            await ckpt.save(1, model_state(1))
    (tmp_path / "file").write_bytes(b"")
    for path in (tmp_path / "file", tmp_path / "file" / "below"):
        with pytest.raises(astage.ConfigurationError, match="directory"):
            async with astage.Checkpointer(path):
                pass


@pytest.mark.anyio
async def test_lifecycle_closing_is_idempotent_and_use_after_close_fails(tmp_path: Path) -> None:
    ckpt = astage.Checkpointer(tmp_path)
    with pytest.raises(astage.ClosedError, match="async with"):
        await ckpt.save(1, model_state(1))
    async with ckpt:
        await ckpt.save(1, model_state(1))
        await ckpt.aclose()
        assert ckpt.closed
        assert ckpt.steps() == [1]
        await ckpt.aclose()
        with pytest.raises(astage.ClosedError, match="closed"):
            await ckpt.save(2, model_state(2))
        with pytest.raises(astage.ClosedError):
            await ckpt.restore()
    with pytest.raises(astage.ClosedError, match="once"):
        async with ckpt:
            pass
    async with astage.Checkpointer(tmp_path) as again:  # the lock was released
        assert again.steps() == [1]


@pytest.mark.anyio
async def test_a_failing_progress_callback_is_logged_and_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: astage.SaveEvent) -> None:
        raise RuntimeError(f"callback broke on {event.kind}")

    with caplog.at_level(logging.INFO, logger="astage.checkpointer"):
        async with astage.Checkpointer(tmp_path, on_progress=broken) as ckpt:
            await ckpt.save(1, model_state(1))
            await ckpt.wait()
            assert ckpt.steps() == [1]
    assert "callback broke on staged" in caplog.text
    assert "committed step 1" in caplog.text


def test_the_public_names_are_exported() -> None:
    for name in ("Checkpointer", "SaveStats", "SaveEvent", "SaveHandle", "Replicator", "ReplicaSource"):
        assert name in astage.__all__
        assert getattr(astage, name).__module__.startswith("astage._checkpointer.")


@pytest.mark.anyio
async def test_a_replicated_save_is_encoded_and_checksummed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On main the local file and the replica were each encoded from the staged copy.
    encodes: list[int] = []
    original = astage._format.codec.FileLayout.encode

    def counted(layout: astage._format.codec.FileLayout) -> astage._format.codec.Encoded:
        encodes.append(layout.step)
        return original(layout)

    monkeypatch.setattr(astage._format.codec.FileLayout, "encode", counted)
    replicator = SharingReplicator(tmp_path / "peer")
    async with astage.Checkpointer(tmp_path / "ckpt", replication=replicator) as ckpt:
        await (await ckpt.save(3, model_state(3))).wait()
    assert encodes == [3]
    [shared] = replicator.received
    assert shared is not None
    assert shared.header.step == 3
    local = (tmp_path / "ckpt" / "step_0000000003" / "rank00000.astage").read_bytes()
    replica = replica_path(tmp_path / "peer", owner_rank=0, holder_rank=1).read_bytes()
    local_header, replica_header = (
        astage._format.codec.parse_prefix(local),
        astage._format.codec.parse_prefix(replica),
    )
    assert (local_header.holder_rank, replica_header.holder_rank) == (None, 1)
    assert local_header.segments == replica_header.segments
    assert local[local_header.prefix_nbytes :] == replica[replica_header.prefix_nbytes :]


@pytest.mark.anyio
async def test_a_replicator_without_encoded_is_called_the_plain_way(tmp_path: Path) -> None:
    replicator = DirectoryReplicator(tmp_path / "peer")
    async with astage.Checkpointer(tmp_path / "ckpt", replication=replicator) as ckpt:
        await (await ckpt.save(1, model_state(1))).wait()
    assert replicator.calls == [1]
    assert replica_path(tmp_path / "peer", owner_rank=0, holder_rank=1).exists()


class UndeclaredReplicator(DirectoryReplicator):
    """Takes ``encoded`` and any other keyword argument, but does not declare
    ``accepts_encoded``: the Checkpointer must not pass them on the strength of a signature."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.extra: list[dict[str, Any]] = []

    async def replicate_staged(  # type: ignore[override]
        self,
        staged: Any,
        *,
        step: int,
        checkpoint_id: str,
        encoded: astage._format.codec.Encoded | None = None,
        **more: Any,
    ) -> Path:
        self.extra.append({"encoded": encoded, **more})
        return await super().replicate_staged(staged, step=step, checkpoint_id=checkpoint_id)


class PlainOverride(SharingReplicator):
    """Inherits the declaration but overrides ``replicate_staged`` without repeating it."""

    async def replicate_staged(self, staged: Any, *, step: int, checkpoint_id: str) -> Path:  # type: ignore[override]
        plain = super(SharingReplicator, self).replicate_staged  # DirectoryReplicator's
        return await plain(staged, step=step, checkpoint_id=checkpoint_id)


@pytest.mark.anyio
async def test_a_replicator_that_only_accepts_encoded_without_declaring_it_is_called_the_plain_way(
    tmp_path: Path,
) -> None:
    replicator = UndeclaredReplicator(tmp_path / "peer")
    async with astage.Checkpointer(tmp_path / "ckpt", replication=replicator) as ckpt:
        await (await ckpt.save(1, model_state(1))).wait()
    assert replicator.calls == [1]
    assert replicator.extra == [{"encoded": None}]


@pytest.mark.anyio
async def test_a_subclass_that_overrides_replicate_staged_without_the_declaration_is_called_the_plain_way(
    tmp_path: Path,
) -> None:
    replicator = PlainOverride(tmp_path / "peer")
    async with astage.Checkpointer(tmp_path / "ckpt", replication=replicator) as ckpt:
        await (await ckpt.save(1, model_state(1))).wait()
    assert replicator.calls == [1]
    assert replicator.received == []
    assert replica_path(tmp_path / "peer", owner_rank=0, holder_rank=1).exists()


def test_replication_stager_declares_that_it_accepts_encoded() -> None:
    assert vars(astage.ReplicationStager)["accepts_encoded"] is True
