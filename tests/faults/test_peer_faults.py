"""Peer faults around a replication, on real gloo groups of three processes.

Every rank first replicates step 1 successfully; then a faulty rank (rank 2: it sends to
rank 0 and receives from rank 1) misbehaves during step 2 while the others replicate.
Every surviving rank must raise an astage error within ``timeout + 1 s`` and hold, at its
replica path, a whole replica that loads: the previous one where the fault came before the
exchange finished, the new one where it came after (the replica was made durable before the
acknowledgement, by design); and no temp file anywhere.  ``test_replication.py`` already
covers a peer killed during the exchange and one stopped before it, on two ranks.

* killed before the exchange (after the successful first round);
* killed, and stopped, after the exchange and after persisting its peer's replica, but before
  acknowledging it: the faulty rank's ``_transport.exchange_ack`` is replaced by its fate, so
  the fault lands exactly there;
* sending a malformed replica: garbage, a re-checksummed hostile header, another rank's
  replica, a corrupt body, a truncated body.  It calls ``_transport.exchange`` directly
  while the others run ``ReplicationStager.replicate``.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import astage
from astage import _transport
from astage._files.durable import is_temp_name, replica_path, sweep_stale_temps
from astage._files.reading import find_replicas, load_checkpoint_file_sync
from astage._format.codec import encode, parse_prefix
from astage._format.encoder import join_prefix
from tests.distributed import RankResult, kill_self, run_group, stop_self
from tests.statedicts import assert_same_tree

TIMEOUT = 2.0
REFUSED = "TransportError: an earlier exchange failed and broke the process group"
WORLD = 3
FAULTY = 2
CHUNK = 64 << 10


def state_of(rank: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s state at ``step``: 256 KiB over four chunks, an alias, JSON leaves."""
    gen = torch.Generator().manual_seed(100 * rank + step)
    weight = torch.randn(256, 256, generator=gen)
    return {
        "w": weight,
        "w_row": weight[3],
        "ids": torch.arange(rank, rank + 4),
        "meta": {"rank": rank, "step": step},
    }


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def _replicate_and_report(rs: astage.ReplicationStager, rank: int, held: Path) -> dict[str, Any]:
    """Replicate step 2, expecting an astage error; report it, its delay, what is held, and
    what a further call says (the group is broken now: it must be refused, not attempted)."""
    before = _digest(held)
    report: dict[str, Any] = {"error": None, "before": before, "held": str(held)}
    for key, step in (("error", 2), ("again", 3)):
        started = time.monotonic()
        try:
            await rs.replicate(state_of(rank, step), step=step)
        except astage.AstageError as exc:
            report[key] = f"{type(exc).__name__}: {exc}"
        else:
            report[key] = None
        report[f"{key}_elapsed"] = time.monotonic() - started
        if report["error"] is None:
            break
    return report


def _ring(rank: int) -> tuple[int, int]:
    return _transport.ring_peers(rank, WORLD)


# -- killed or stopped --------------------------------------------------------------------------


def _fate_before_acking(fate: Callable[[], None]) -> None:
    """Replace this process's acknowledgement by ``fate``: the replica it received is durable."""

    async def instead(*args: Any, **kwargs: Any) -> None:
        fate()

    _transport.exchange_ack = instead  # type: ignore[assignment]


async def peer_fault(rank: int, world: int, root: str, fault: str) -> dict[str, Any]:
    storage = Path(root) / f"rank{rank}"
    sync = dist.new_group()
    async with astage.ReplicationStager(storage_dir=storage, timeout=TIMEOUT, chunk_bytes=CHUNK) as rs:
        first = await rs.replicate(state_of(rank, 1), step=1)
        dist.barrier(group=sync)  # every first round is over before anyone fails
        if rank == FAULTY:
            if fault == "killed before the exchange":
                kill_self()
            _fate_before_acking(kill_self if fault.startswith("killed") else stop_self)
        return await _replicate_and_report(rs, rank, first.replica_path)


# fault: (the held replica's step on the rank that receives from the faulty one, on the other)
PEER_FAULTS = {
    "killed before the exchange": ({1}, {1, 2}),
    "killed after the exchange, before the ack": ({2}, {2}),
    "stopped after the exchange, before the ack": ({2}, {2}),
}


def check_survivors(
    results: list[RankResult], root: Path, held_steps: tuple[set[int], set[int]]
) -> list[float]:
    """Each survivor raised within the timeout and holds a whole replica; returns the delays."""
    delays = []
    for result in results[:FAULTY]:
        value = result.unwrap()
        assert value["error"] is not None, f"rank {result.rank} did not fail"
        assert value["error_elapsed"] < TIMEOUT + 1.0, value
        delays.append(value["error_elapsed"])
        assert (value["again"] or "").startswith(REFUSED), (result.rank, value["error"], value["again"])
        assert value["again_elapsed"] < 0.5, value
        held = Path(value["held"])
        owner = _ring(result.rank)[1]
        assert held == replica_path(held.parent, owner_rank=owner, holder_rank=result.rank)
        (info,) = find_replicas(held.parent)
        allowed = held_steps[0] if owner == FAULTY else held_steps[1]
        assert info.step in allowed, (result.rank, info.step, value)
        if info.step == 1:
            assert _digest(held) == value["before"], "the previous replica changed"
        assert_same_tree(load_checkpoint_file_sync(held), state_of(owner, info.step))
    victim = root / f"rank{FAULTY}"
    for path in root.rglob("*"):
        assert path.parent == victim or not is_temp_name(path.name), path
    # The faulty rank may die mid-write; its next start sweeps what it left.
    sweep_stale_temps(victim)
    assert not any(is_temp_name(p.name) for p in victim.rglob("*"))
    return delays


@pytest.mark.parametrize("fault", list(PEER_FAULTS))
def test_survivors_of_a_dead_or_frozen_peer_fail_in_time_and_keep_a_whole_replica(
    tmp_path: Path, fault: str, record_property: Callable[[str, object], None]
) -> None:
    results = run_group(WORLD, peer_fault, str(tmp_path), fault, timeout=60)
    victim = results[FAULTY]
    assert victim.stopped if fault.startswith("stopped") else victim.killed, victim.describe()
    delays = check_survivors(results, tmp_path, PEER_FAULTS[fault])
    record_property("survivor_delays_s", delays)
    if "after the exchange" in fault:
        # The faulty rank had made the replica it received durable before its fate.
        (info,) = find_replicas(tmp_path / f"rank{FAULTY}")
        assert info.step == 2
        for result in results[:FAULTY]:
            assert result.value["error"].startswith(("TransportError: ", "PeerTimeoutError: "))


# -- a malformed replica ---------------------------------------------------------------------------


def _real_replica(owner: int, step: int) -> tuple[bytes, bytes]:
    """The prefix and body of ``owner``'s replica at ``step``, as its stager would send them."""
    encoded = encode(state_of(owner, step), owner_rank=owner, step=step, checkpoint_id="x", created=0.0)
    data = b"".join(encoded.buffers())
    return data[: len(encoded.prefix)], data[len(encoded.prefix) :]


def malformed(case: str) -> tuple[bytes, bytes]:
    """What the faulty rank sends in ``case``: a prefix and a body."""
    prefix, body = _real_replica(FAULTY, 2)
    if case == "garbage":
        return random.Random(0).randbytes(300), body
    if case == "hostile header":
        # The header is the binary tables, the structure, then the values: a key added to those.
        header = prefix[20 : 20 + int.from_bytes(prefix[12:20], "little")]
        tables, _, doc = header.partition(b'{"format":')
        version = b"%d," % astage._format.codec.FORMAT_VERSION
        hostile = tables + b'{"format":' + doc.replace(version, version + b'"exec":"__import__(\'os\')",', 1)
        assert hostile != header
        return join_prefix([hostile]), body
    if case == "another rank's replica":
        return _real_replica(1, 2)
    if case == "corrupt body":
        damaged = bytearray(body)
        damaged[len(damaged) // 2] ^= 0x10
        return prefix, bytes(damaged)
    assert case == "truncated body"
    return prefix, body[: len(body) // 2]


MALFORMED = ("garbage", "hostile header", "another rank's replica", "corrupt body", "truncated body")


def _case_dir(root: str | Path, case: str) -> Path:
    return Path(root) / case.replace(" ", "-").replace("'", "")


async def malformed_peer(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    out = {}
    for case in MALFORMED:
        group = dist.new_group(list(range(WORLD)))  # a fresh group per case: a case may break it
        storage = _case_dir(root, case) / f"rank{rank}"
        async with astage.ReplicationStager(
            group, storage_dir=storage, timeout=TIMEOUT, chunk_bytes=CHUNK
        ) as rs:
            first = await rs.replicate(state_of(rank, 1), step=1)
            dist.barrier()
            if rank == FAULTY:
                prefix, body = malformed(case)
                payload = _transport.Payload(
                    prefix, [(0, torch.frombuffer(bytearray(body), dtype=torch.uint8))], len(body)
                )
                send_to, recv_from = _ring(rank)
                with contextlib.suppress(astage.AstageError):
                    await _transport.exchange(
                        group,
                        payload,
                        send_to=send_to,
                        recv_from=recv_from,
                        timeout=TIMEOUT,
                        max_body_bytes=1 << 30,
                        chunk_bytes=CHUNK,
                    )
            else:
                out[case] = await _replicate_and_report(rs, rank, first.replica_path)
        dist.barrier()
    return out


def test_survivors_of_a_peer_sending_a_malformed_replica_fail_in_time_and_keep_theirs(
    tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    results = run_group(WORLD, malformed_peer, str(tmp_path), timeout=120)
    results[FAULTY].unwrap()
    for case in MALFORMED:
        per_case = [RankResult(r.rank, value=r.value[case]) for r in results[:FAULTY]]
        delays = check_survivors([*per_case, results[FAULTY]], _case_dir(tmp_path, case), ({1}, {1, 2}))
        record_property(case, delays)
        receiver = next(r for r in per_case if _ring(r.rank)[1] == FAULTY)
        assert receiver.value["error"].startswith("IntegrityError: "), (case, receiver.value)


def test_the_malformed_cases_are_what_they_claim() -> None:
    prefix, body = _real_replica(FAULTY, 2)
    with pytest.raises(astage.IntegrityError, match="magic"):
        parse_prefix(malformed("garbage")[0])
    with pytest.raises(astage.IntegrityError, match="header document"):
        parse_prefix(malformed("hostile header")[0])  # its checksum is right
    assert parse_prefix(malformed("another rank's replica")[0]).owner_rank == 1
    damaged = malformed("corrupt body")
    assert damaged[0] == prefix
    assert sum(a != b for a, b in zip(damaged[1], body, strict=True)) == 1
    assert malformed("truncated body") == (prefix, body[: len(body) // 2])
