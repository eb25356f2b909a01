"""ReplicationStager over real gloo groups: rings of 2, 3 and 4 ranks, a subgroup, faults."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist

import astage
from astage import ConfigurationError, PeerTimeoutError, PersistError, TransportError
from astage._files.durable import is_temp_name, replica_path
from astage._format.codec import FileLayout, encode
from tests.distributed import kill_self, run_group, stop_self
from tests.statedicts import rank_state, same_state, storage_key

TIMEOUT = 4.0


def state_of(rank: int, size: int = 1000) -> dict[str, Any]:
    """A rank's distinctive state: aliasing, a Parameter, JSON leaves, several dtypes."""
    meta = {"rank": rank, "lr": 0.5, "name": f"r{rank}", "tags": [1, None, True]}
    return rank_state(1000 + rank, rank, meta, size)


async def ring_target(rank: int, world: int, root: str, subgroup: list[int] | None) -> dict[str, Any]:
    group = dist.new_group(subgroup) if subgroup else None
    if subgroup and rank not in subgroup:
        return {"skipped": True}
    grank = dist.get_rank(group)
    storage = Path(root) / f"rank{rank}"
    async with astage.ReplicationStager(group, storage_dir=storage, timeout=30) as rs:
        result = await rs.replicate(state_of(grank), step=3)
        replica = result.replica
        loaded = await astage.load_checkpoint_file(result.replica_path)
        own_ok = same_state(result.staged, state_of(grank))
        listed = astage.find_replicas(storage)
    gsize = dist.get_world_size(group)
    peer = (grank - gsize // 2) % gsize
    return {
        "recv_from": result.recv_from,
        "expected_peer": peer,
        "replica_ok": same_state(replica, state_of(peer)),
        "loaded_ok": same_state(loaded, state_of(peer)),
        "aliased": storage_key(replica["model"]["w"]) == storage_key(replica["model"]["w_t"]),
        "own_ok": own_ok,
        "mode": oct(os.stat(result.replica_path).st_mode & 0o777),
        "listed": [(i.owner_rank, i.holder_rank, i.step) for i in listed],
        "owner": result.replica_header.owner_rank,
        "grank": grank,
    }


@pytest.mark.parametrize(("world", "subgroup"), [(2, None), (3, None), (4, None), (4, [1, 2, 3])])
def test_every_rank_holds_exactly_its_ring_peers_replica(
    tmp_path: Path, world: int, subgroup: list[int] | None
) -> None:
    results = run_group(world, ring_target, str(tmp_path), subgroup, timeout=90)
    members = [r.unwrap() for r in results if not r.unwrap().get("skipped")]
    assert len(members) == (len(subgroup) if subgroup else world)
    for value in members:
        assert value["recv_from"] == value["expected_peer"] == value["owner"]
        assert value["replica_ok"]
        assert value["loaded_ok"]
        assert value["aliased"]
        assert value["own_ok"]
        assert value["mode"] == "0o600"
        assert value["listed"] == [(value["recv_from"], value["grank"], 3)]


async def single_rank_target(rank: int, world: int, root: str) -> str:
    try:
        astage.ReplicationStager(storage_dir=root)
    except ConfigurationError as exc:
        return str(exc)
    return "no error"


def test_a_group_of_one_is_a_configuration_error(tmp_path: Path) -> None:
    (result,) = run_group(1, single_rank_target, str(tmp_path))
    assert "at least 2 ranks" in result.unwrap()


def test_without_a_process_group_it_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="process group"):
        astage.ReplicationStager(storage_dir=tmp_path)


async def fault_target(rank: int, world: int, root: str, fault: str) -> dict[str, Any]:
    storage = Path(root) / f"rank{rank}"
    async with astage.ReplicationStager(storage_dir=storage, timeout=TIMEOUT, chunk_bytes=1 << 20) as rs:
        first = await rs.replicate(state_of(rank), step=1)
        before = first.replica_path.read_bytes()
        big = {"x": torch.full((48 << 20,), float(rank))}  # 192 MB: several chunks in flight
        if rank == 1:
            if fault == "kill":

                async def die() -> None:
                    await anyio.sleep(0.05)
                    kill_self()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(die)
                    await rs.replicate(big, step=2)
            elif fault == "stop":
                stop_self()
            elif fault == "persist":
                target = replica_path(storage, owner_rank=0, holder_rank=1)
                target.unlink()
                target.mkdir()  # os.replace onto a directory fails for real
                try:
                    await rs.replicate(state_of(rank), step=2)
                except PersistError as exc:
                    return {"error": type(exc).__name__, "message": str(exc)}
                return {"error": None}
        started = time.monotonic()
        try:
            await rs.replicate(big if fault != "persist" else state_of(rank), step=2)
        except TransportError as exc:
            error: BaseException = exc
        else:
            return {"error": None}
        elapsed = time.monotonic() - started
        after = first.replica_path.read_bytes()
        leftovers = [p.name for p in storage.iterdir() if is_temp_name(p.name)]
        return {
            "error": type(error).__name__,
            "message": str(error),
            "elapsed": elapsed,
            "previous_intact": after == before,
            "leftovers": leftovers,
        }


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_dead_or_frozen_peer_is_an_error_within_the_timeout(tmp_path: Path, fault: str) -> None:
    survivor, victim = run_group(2, fault_target, str(tmp_path), fault, timeout=60)
    assert victim.killed if fault == "kill" else victim.stopped
    value = survivor.unwrap()
    assert value["error"] in {"TransportError", "PeerTimeoutError"}, value
    assert value["elapsed"] < TIMEOUT + 1.0, value
    assert value["previous_intact"]
    assert value["leftovers"] == []


def test_when_the_receiver_cannot_persist_both_sides_fail(tmp_path: Path) -> None:
    sender, receiver = run_group(2, fault_target, str(tmp_path), "persist", timeout=60)
    assert receiver.unwrap()["error"] == "PersistError"
    sent = sender.unwrap()
    assert sent["error"] == "PeerReportedError"
    assert "could not keep it" in sent["message"]


async def corrupt_target(rank: int, world: int, root: str) -> dict[str, Any]:
    storage = Path(root) / f"rank{rank}"
    async with astage.ReplicationStager(storage_dir=storage, timeout=30, chunk_bytes=64 << 10) as rs:
        first = await rs.replicate(state_of(rank, 100_000), step=1)
        before = first.replica_path.read_bytes()
        real_encode = FileLayout.encode

        def encode_then_damage(self: FileLayout) -> Any:
            encoded = real_encode(self)
            _, data = encoded.segments[0]
            data[-1] ^= 1  # after the checksums were taken: the peer must notice
            return encoded

        if rank == 0:
            FileLayout.encode = encode_then_damage  # type: ignore[method-assign]
        try:
            await rs.replicate(state_of(rank, 100_000), step=2)
        except astage.AstageError as exc:
            error: str | None = f"{type(exc).__name__}: {exc}"
        else:
            error = None
        finally:
            FileLayout.encode = real_encode  # type: ignore[method-assign]
        kept = first.replica_path.read_bytes()
        again = await rs.replicate(state_of(rank, 100_000), step=3)  # the group is intact
        again_ok = same_state(again.replica, state_of(1 - rank, 100_000))
    return {
        "error": error,
        "previous_intact": kept == before,
        "leftovers": [p.name for p in storage.iterdir() if is_temp_name(p.name)],
        "again_ok": again_ok,
    }


def test_a_replica_damaged_on_the_way_is_refused_by_both_sides(tmp_path: Path) -> None:
    sender, receiver = (r.unwrap() for r in run_group(2, corrupt_target, str(tmp_path), timeout=60))
    assert receiver["error"] is not None
    assert receiver["error"].startswith("IntegrityError"), receiver
    assert "checksum mismatch" in receiver["error"]
    assert sender["error"] is not None
    assert sender["error"].startswith("PeerReportedError"), sender
    assert receiver["previous_intact"]
    assert sender["leftovers"] == receiver["leftovers"] == []
    assert sender["again_ok"]
    assert receiver["again_ok"]


async def inbox_target(rank: int, world: int, root: str) -> dict[str, Any]:
    peer = 1 - rank
    async with astage.ReplicationStager(storage_dir=Path(root) / f"rank{rank}", timeout=30) as rs:
        first = await rs.replicate(state_of(rank), step=1)
        held = first.replica
        second = await rs.replicate(state_of(rank + 10), step=2)
        body = second.replica_header.body_nbytes
        result = {
            "held_intact": same_state(held, state_of(peer)),
            "second_ok": same_state(second.replica, state_of(peer + 10)),
        }
        del first, held, second
        for step in range(3, 6):
            latest = await rs.replicate(state_of(rank + step), step=step)
            result["latest_ok"] = same_state(latest.replica, state_of(peer + step))
            del latest
        result["buffers_allocated"] = rs.inbox_stats().allocated_bytes_ever // body
        return result


def test_received_replicas_reuse_buffers_but_never_overwrite_a_held_one(tmp_path: Path) -> None:
    for result in run_group(2, inbox_target, str(tmp_path), timeout=60):
        value = result.unwrap()
        assert value["held_intact"]
        assert value["second_ok"]
        assert value["latest_ok"]
        assert value["buffers_allocated"] == 2  # two replicas were held at once, no more


async def recover_target(rank: int, world: int, root: str) -> Any:
    storage = Path(root) / f"rank{rank}"
    async with astage.ReplicationStager(storage_dir=storage, timeout=30) as rs:
        await rs.replicate(state_of(rank), step=5)
    # "Restart": a new stager, as after a process restart, gets its state back from the peer.
    async with astage.ReplicationStager(storage_dir=storage, timeout=30) as rs:
        recovered = await rs.recover()
    return same_state(recovered, state_of(rank))


def test_a_restarted_rank_gets_its_state_back_from_its_peer(tmp_path: Path) -> None:
    results = run_group(3, recover_target, str(tmp_path), timeout=90)
    assert [r.unwrap() for r in results] == [True, True, True]


def test_peer_timeout_error_is_a_transport_error() -> None:
    assert issubclass(PeerTimeoutError, TransportError)
    assert issubclass(astage.PeerReportedError, TransportError)


async def shared_encoding_target(rank: int, world: int, root: str) -> dict[str, Any]:
    state = state_of(rank)
    encoded = encode(state, owner_rank=rank, step=3, checkpoint_id="c")
    async with astage.ReplicationStager(storage_dir=Path(root) / f"rank{rank}", timeout=30) as rs:
        refused = ""
        try:  # another step: refused before anything is sent, so the ranks stay in step
            await rs.replicate_staged(state, step=4, checkpoint_id="c", encoded=encoded)
        except ConfigurationError as exc:
            refused = str(exc)
        result = await rs.replicate_staged(state, step=3, checkpoint_id="c", encoded=encoded)
        return {
            "refused": refused,
            "replica_ok": same_state(result.replica, state_of(result.recv_from)),
            "ranks": (result.replica_header.owner_rank, result.replica_header.holder_rank),
            "expected": (result.recv_from, rank),
            "sent": result.stats.bytes_sent == encoded.total_nbytes,
        }


def test_replicate_staged_sends_a_replica_encoded_beforehand_relabelled(tmp_path: Path) -> None:
    for value in (r.unwrap() for r in run_group(2, shared_encoding_target, str(tmp_path), timeout=90)):
        assert "same step and checkpoint_id" in value["refused"]
        assert value["replica_ok"]
        assert value["ranks"] == value["expected"]
        assert value["sent"]


def advance(state: dict[str, Any], step: int) -> None:
    """One training step, in place (the same storages, as an optimizer writes them), and
    the scalars a training loop changes with it (a learning rate, a count in a list)."""
    with torch.no_grad():
        state["model"]["w"].add_(step)
        state["model"]["p"].mul_(step + 1)
    state["meta"]["lr"] = 0.5 / step
    state["meta"]["tags"][0] = step
    if step == 4:  # a new structure: laid out anew
        state["model"]["extra"] = torch.arange(3)


async def kept_layout_target(rank: int, world: int, root: str) -> dict[int, dict[str, Any]]:
    peer = 1 - rank
    out: dict[int, dict[str, Any]] = {}
    async with astage.ReplicationStager(storage_dir=Path(root) / f"rank{rank}", timeout=30) as rs:
        state, want = state_of(rank), state_of(peer)
        for step in range(1, 5):
            advance(state, step)
            advance(want, step)
            result = await rs.replicate(state, step=step)
            kept = rs._layouts._kept
            assert result.stats.stage is not None
            out[step] = {
                "ok": same_state(result.replica, want),
                "refilled": result.stats.stage.refilled,
                "walked": kept is not None and kept.copy == result.stats.stage.copy and not kept.fast.guards,
                "headers reused": rs._headers.reused,
            }
            if kept is not None:
                # Its plan armed its guards; a check of a chunk that finds none arms one again.
                kept.fast.guards.clear()
            await rs.stager.release(result.staged)
            del result
    return out


def test_repeated_replication_re_uses_the_layout_of_a_refilled_copy(tmp_path: Path) -> None:
    # replicate() encodes each round; a copy the stager refilled in place re-uses the kept
    # layout, walked not re-checked, and every replica is still the peer's exact state.
    # The holder parses a repeated structure's header with the plan it kept (steps 2 and
    # 3), and in full when the structure changes (step 4).  A learning rate and a count
    # change every step: scalars, which none of that re-plans for.
    for result in run_group(2, kept_layout_target, str(tmp_path), timeout=90):
        rounds = result.unwrap()
        assert all(rounds[step]["ok"] for step in range(1, 5)), rounds
        assert [rounds[step]["refilled"] for step in range(1, 5)] == [False, True, True, False]
        assert [rounds[step]["walked"] for step in range(2, 4)] == [True, True]
        assert [rounds[step]["headers reused"] for step in range(1, 5)] == [0, 1, 2, 2]
