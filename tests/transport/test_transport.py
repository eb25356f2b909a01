"""The transport moves replicas between real processes joined in gloo groups on loopback.

Each multi-process test spawns one group (see ``distributed.py``) that runs several cases;
the children check what they received themselves and report plain values back.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import anyio
import numpy as np
import pytest
import torch
import torch.distributed as dist

import astage
from astage._format.encoded import StorageSegments as _StorageSegments
from astage._transport import (
    MAGIC,
    PREAMBLE_TAG,
    PREAMBLE_WORDS,
    VERSION,
    Payload,
    exchange,
    exchange_ack,
    plan_chunks,
    recv,
    recv_ack,
    ring_peers,
    send,
    send_ack,
)
from astage._transport.exchange import _pack
from astage._transport.protocol import Gather
from astage._util.timeslice import drive
from tests.distributed import RankResult, kill_self, run_group, stop_self
from tests.payloads import KINDS, SMALL_CHUNK, body_of, check_received, make_payload, outcome, ring_cases


def results_of(results: list[RankResult]) -> list[Any]:
    return [r.unwrap() for r in results]


# -- children ---------------------------------------------------------------------------


async def world_2(rank: int, world: int) -> dict[str, Any]:
    moved = await ring_cases(None, None, KINDS)
    moved += await ring_cases(None, None, ("big",), chunk_bytes=astage._transport.CHUNK_BYTES)

    # allocate and on_chunk: chunks arrive in order, already final, while others fly.
    seen: list[tuple[int, int]] = []
    expected = body_of(make_payload(1 - rank, "big"))

    async def on_prefix(prefix: bytes) -> None:
        assert prefix == make_payload(1 - rank, "big").prefix
        seen.append((-1, len(prefix)))

    def allocate(nbytes: int) -> torch.Tensor:
        seen.append((-2, nbytes))
        return torch.full((nbytes + 10,), 7, dtype=torch.uint8)

    async def on_chunk(offset: int, chunk: torch.Tensor) -> None:
        assert chunk.numpy().tobytes() == expected[offset : offset + chunk.numel()]
        seen.append((offset, chunk.numel()))

    got = await exchange(
        None,
        make_payload(rank, "big"),
        send_to=1 - rank,
        recv_from=1 - rank,
        timeout=30,
        max_body_bytes=8 << 20,
        chunk_bytes=SMALL_CHUNK,
        allocate=allocate,
        on_prefix=on_prefix,
        on_chunk=on_chunk,
    )
    check_received(got, 1 - rank, "big")
    assert seen[:2] == [(-1, 4), (-2, len(expected))]  # the prefix first, then the body
    assert [o for o, _ in seen[2:]] == list(range(0, len(expected), SMALL_CHUNK))
    assert sum(n for _, n in seen[2:]) == len(expected)

    # The loop keeps ticking while the transfer waits for a late peer and moves 16 MiB.
    big = Payload(b"", [(0, torch.ones(16 << 20, dtype=torch.uint8))], 16 << 20)
    gaps: list[float] = []
    async with anyio.create_task_group() as tg:

        async def heartbeat() -> None:
            last = time.perf_counter()
            while True:
                await anyio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tg.start_soon(heartbeat)
        if rank == 1:
            await anyio.sleep(0.5)
        await exchange(None, big, send_to=1 - rank, recv_from=1 - rank, timeout=30, max_body_bytes=16 << 20)
        tg.cancel_scope.cancel()
    return {"moved": moved, "ticks": len(gaps), "max_gap": max(gaps)}


async def world_3(rank: int, world: int) -> list[tuple[int, int]]:
    return await ring_cases(None, None, ("tiny", "big")) + await ring_cases(None, 2, ("big",))


async def world_4(rank: int, world: int) -> list[tuple[int, int]]:
    moved = await ring_cases(None, None, ("big", "sparse"))
    moved += await ring_cases(None, 1, ("tiny",))
    moved += await ring_cases(None, 3, ("big",))
    sub = dist.new_group([1, 2, 3])  # every rank must take part in creating it
    if rank in (1, 2, 3):
        moved += await ring_cases(sub, None, ("tiny", "big", "header-only"))
    return moved


def test_every_rank_receives_its_ring_peers_payload_on_2_ranks() -> None:
    out = results_of(run_group(2, world_2))
    for rank, result in enumerate(out):
        sent = [s for s, _ in result["moved"]]
        assert sent == [r for _, r in out[1 - rank]["moved"]]
    for result in out:
        assert result["ticks"] > 50
        assert result["max_gap"] < 0.25


def test_every_rank_receives_its_ring_peers_payload_on_3_ranks_under_trio() -> None:
    results_of(run_group(3, world_3, backend="trio"))


def test_every_rank_receives_its_ring_peers_payload_on_4_ranks_and_a_subgroup() -> None:
    out = results_of(run_group(4, world_4))
    assert len(out[0]) == 4
    assert all(len(moved) == 7 for moved in out[1:])


# -- failures: dead and hung peers ------------------------------------------------------

TIMEOUT = 2.0


async def exchange_until_failure(
    rank: int, world: int, victim: int, fate: Callable[[], None]
) -> tuple[str, str, float]:
    """The victim meets ``fate`` at its first received chunk; survivors report their error."""
    send_to, recv_from = ring_peers(rank, world, 1)

    async def on_chunk(offset: int, chunk: torch.Tensor) -> None:
        if rank == victim:
            fate()

    payload = Payload(b"x", [(0, torch.ones(8 << 20, dtype=torch.uint8))], 8 << 20)
    started = time.monotonic()
    try:
        await exchange(
            None,
            payload,
            send_to=send_to,
            recv_from=recv_from,
            timeout=TIMEOUT,
            max_body_bytes=8 << 20,
            chunk_bytes=SMALL_CHUNK,
            on_chunk=on_chunk,
        )
    except astage.TransportError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - started
    return "no error", "", time.monotonic() - started


async def peer_killed(rank: int, world: int) -> tuple[str, str, float]:
    return await exchange_until_failure(rank, world, 2, kill_self)


async def peer_stopped(rank: int, world: int) -> tuple[str, str, float]:
    return await exchange_until_failure(rank, world, 1, stop_self)


def test_a_peer_killed_mid_transfer_fails_every_survivor_quickly() -> None:
    results = run_group(3, peer_killed)
    assert results[2].killed
    for survivor in results[:2]:
        kind, message, elapsed = survivor.unwrap()
        assert kind in ("TransportError", "PeerTimeoutError"), message
        assert elapsed < TIMEOUT + 1.0


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_stopped_peer_times_out_on_the_survivor(backend: str) -> None:
    results = run_group(2, peer_stopped, backend=backend)
    assert results[1].stopped
    kind, message, elapsed = results[0].unwrap()
    assert kind == "PeerTimeoutError", message
    assert "rank 1" in message
    assert TIMEOUT - 0.05 <= elapsed < TIMEOUT + 1.0


# -- acknowledgements, malformed peers, cancellation, bad arguments ---------------------


def fresh_pair() -> dist.ProcessGroup:
    """A new group of ranks 0 and 1, so that breaking it leaves the default group intact."""
    group = dist.new_group([0, 1])
    assert group is not None
    return group


async def isend_raw(pg: dist.ProcessGroup, tensor: torch.Tensor, tag: int) -> None:
    work = dist.isend(tensor, group=pg, group_dst=0, tag=tag)
    assert work is not None
    await anyio.to_thread.run_sync(work.wait, timedelta(seconds=10))


async def misc(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    peer = 1 - rank

    # Acknowledgements, both ways at once: rank 1 could not persist rank 0's replica.
    ok = rank == 0
    out["exchange_ack"] = await outcome(
        exchange_ack(
            None, ok, send_to=peer, recv_from=peer, timeout=10, message="" if ok else "disk full (ENOSPC)"
        )
    )
    # One way: rank 0 reports a failure that rank 1 receives.
    if rank == 0:
        out["ack"] = await outcome(
            send_ack(None, 1, False, timeout=10, message="fsync failed: EIO " + "é" * 300)
        )
    else:
        out["ack"] = await outcome(recv_ack(None, 0, timeout=10))

    # Malformed preambles are refused before anything is allocated.
    cases = {
        "bad magic": [MAGIC ^ 1, VERSION, 0, 16, 1 << 16],
        "bad version": [MAGIC, VERSION + 1, 0, 16, 1 << 16],
        "absurd prefix": [MAGIC, VERSION, 1 << 50, 16, 1 << 16],
        "negative body": [MAGIC, VERSION, 0, -5, 1 << 16],
        "body over cap": [MAGIC, VERSION, 0, 2 << 20, 1 << 16],
        "tiny chunks": [MAGIC, VERSION, 0, 16, 1],
    }
    allocations: list[int] = []

    def allocate(nbytes: int) -> torch.Tensor:
        allocations.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    for name, words in cases.items():
        pg = fresh_pair()
        if rank == 1:
            preamble = torch.tensor(words + [0] * (PREAMBLE_WORDS - len(words)), dtype=torch.int64)
            await isend_raw(pg, preamble, PREAMBLE_TAG)
        else:
            out[name] = await outcome(
                recv(pg, from_=1, timeout=10, max_body_bytes=1 << 20, allocate=allocate)
            )
    # A prefix that on_prefix refuses aborts the transfer before the body is allocated.
    pg = fresh_pair()
    if rank == 1:
        out["refused sender"] = await outcome(send(pg, make_payload(1, "big"), to=0, timeout=10))
    else:

        async def refuse(prefix: bytes) -> None:
            raise astage.IntegrityError(f"not a header: {prefix!r}")

        call = recv(pg, from_=1, timeout=10, max_body_bytes=8 << 20, allocate=allocate, on_prefix=refuse)
        out["refused prefix"] = await outcome(call)
    out["allocations"] = allocations

    # Cancelling an exchange is prompt, and breaks the group so the peer fails at once.
    pg = fresh_pair()
    payload = Payload(b"", [(0, torch.ones(1 << 20, dtype=torch.uint8))], 1 << 20)
    started = time.monotonic()
    if rank == 0:
        with anyio.move_on_after(0.2):
            await exchange(pg, payload, send_to=1, recv_from=1, timeout=10, max_body_bytes=1 << 20)
        out["cancelled_after"] = time.monotonic() - started
    # Rank 1 starts its exchange only once rank 0's was cancelled (the default group is intact).
    await anyio.to_thread.run_sync(dist.barrier)
    if rank == 1:
        started = time.monotonic()
        out["after_peer_cancelled"] = await outcome(
            exchange(pg, payload, send_to=0, recv_from=0, timeout=10, max_body_bytes=1 << 20)
        )
        out["peer_failed_after"] = time.monotonic() - started

    # Bad arguments, caught before anything is posted.
    good: dict[str, Any] = {"send_to": peer, "recv_from": peer, "timeout": 1, "max_body_bytes": 0}
    bad_args = {
        "to self": {"send_to": rank},
        "out of range": {"recv_from": 2},
        "zero timeout": {"timeout": 0},
        "nan timeout": {"timeout": math.nan},
        "tiny chunk": {"chunk_bytes": 16},
        "negative cap": {"max_body_bytes": -1},
    }
    for name, change in bad_args.items():
        out[f"args: {name}"] = await outcome(exchange(None, Payload(b"", [], 0), **(good | change)))

    # The default group is still healthy after all the subgroups we broke.
    out["still healthy"] = await ring_cases(None, None, ("big",))
    return out


@pytest.fixture(scope="module")
def misc_results() -> list[dict[str, Any]]:
    return results_of(run_group(2, misc))


def test_a_failed_ack_reaches_the_sender_with_the_peers_message(misc_results: list[dict[str, Any]]) -> None:
    rank0, rank1 = misc_results
    assert rank0["exchange_ack"] == "PeerReportedError: rank 1 reports failure: disk full (ENOSPC)"
    assert rank1["exchange_ack"] == "ok"
    assert rank0["ack"] == "ok"
    assert rank1["ack"].startswith("PeerReportedError: rank 0 reports failure: fsync failed: EIO éé")
    assert "\ufffd" not in rank1["ack"]  # the message was cut on a character boundary


def test_malformed_preambles_are_refused_before_allocating(misc_results: list[dict[str, Any]]) -> None:
    rank0 = misc_results[0]
    assert rank0["bad magic"].startswith("IntegrityError: rank 1 sent a preamble with bad magic")
    assert rank0["bad version"].startswith("IntegrityError: rank 1 speaks transport version 2")
    assert (
        rank0["absurd prefix"]
        == f"IntegrityError: rank 1 announces a prefix of {1 << 50} B; the cap is {64 << 20} B"
    )
    assert rank0["negative body"].startswith("IntegrityError: rank 1 announces a body of -5 B")
    assert rank0["body over cap"].startswith(f"IntegrityError: rank 1 announces a body of {2 << 20} B")
    assert rank0["tiny chunks"].startswith("IntegrityError: rank 1's chunk size must be in")
    assert rank0["allocations"] == []


def test_a_prefix_refused_by_on_prefix_aborts_both_sides(misc_results: list[dict[str, Any]]) -> None:
    rank0, rank1 = misc_results
    assert rank0["refused prefix"] == "IntegrityError: not a header: b'hdr\\x01'"
    assert rank1["refused sender"].startswith("TransportError: rank 1: sending to rank 0: ")
    assert rank0["allocations"] == []


def test_cancelling_an_exchange_is_prompt_and_fails_the_peer_at_once(
    misc_results: list[dict[str, Any]],
) -> None:
    rank0, rank1 = misc_results
    assert rank0["cancelled_after"] < 0.5
    assert rank1["after_peer_cancelled"].startswith("TransportError: rank 1: ")
    assert rank1["peer_failed_after"] < 1.5  # at once: the timeout is 10 s


def test_bad_arguments_are_configuration_errors(misc_results: list[dict[str, Any]]) -> None:
    for result in misc_results:
        for key, value in result.items():
            if key.startswith("args: "):
                assert value.startswith("ConfigurationError: "), (key, value)
    assert misc_results[0]["still healthy"]


# -- pure parts, no process group -------------------------------------------------------


def test_ring_peers() -> None:
    assert ring_peers(0, 2) == (1, 1)
    assert [ring_peers(r, 3) for r in range(3)] == [(1, 2), (2, 0), (0, 1)]
    assert [ring_peers(r, 4) for r in range(4)] == [(2, 2), (3, 3), (0, 0), (1, 1)]
    assert ring_peers(0, 4, offset=1) == (1, 3)
    assert ring_peers(0, 5, offset=-1) == (4, 1)
    for world, offset in ((1, None), (4, 4), (4, 0), (3, -3)):
        with pytest.raises(astage.ConfigurationError):
            ring_peers(0, world, offset)
    with pytest.raises(astage.ConfigurationError):
        ring_peers(3, 3)


def test_chunks_covered_by_one_segment_are_views_and_the_rest_are_packed() -> None:
    a = torch.arange(10_000, dtype=torch.int64).to(torch.uint8)
    b = torch.ones(100, dtype=torch.uint8)
    plan = drive(
        plan_chunks([(100, a), (10_200, b), (10_300, torch.empty(0, dtype=torch.uint8))], 16_384, 4096)
    )
    assert [(c.offset, c.nbytes) for c in plan.chunks] == [
        (0, 4096),
        (4096, 4096),
        (8192, 4096),
        (12288, 4096),
    ]
    first, middle, last, zeros = (c.parts for c in plan.chunks)
    assert first[0] == 100
    assert first[1].data_ptr() == a.data_ptr()
    assert len(middle) == 1
    assert middle[0].data_ptr() == a.data_ptr() + 3996  # a view, no copy
    assert [p if isinstance(p, int) else p.numel() for p in last] == [1908, 100, 100, 1988]
    assert zeros == (4096,)


def test_a_plan_over_many_small_segments_covers_the_body_exactly_in_short_slices() -> None:
    # 20,000 small storages 64-byte aligned, as the checkpoint file format lays them out: every byte of
    # the body comes from its segment or is a zero gap, whatever the chunk grid, and the walk
    # gives the loop a turn (a walk that never yielded would hold it for the whole plan).
    gen = torch.Generator().manual_seed(3)
    sizes = torch.randint(1, 1100, (20_000,), generator=gen).tolist()
    segments, offset = [], 0
    for i, n in enumerate(sizes):
        segments.append((offset, torch.full((n,), i % 251 + 1, dtype=torch.uint8)))
        offset = -(-(offset + n) // 64) * 64
    body_nbytes = offset + 100
    expected = torch.zeros(body_nbytes, dtype=torch.uint8)
    for at, t in segments:
        expected[at : at + t.numel()] = t
    for chunk_bytes in (4096, 1 << 20, 64 << 20):
        slices: list[float] = []
        started = time.perf_counter()

        def lap(slices: list[float] = slices) -> None:
            nonlocal started
            slices.append(time.perf_counter() - started)
            started = time.perf_counter()

        plan = drive(plan_chunks(segments, body_nbytes, chunk_bytes), between=lap)
        assert len(slices) >= 2
        assert sorted(slices)[len(slices) // 2] < 0.005
        got = torch.cat(
            [
                p if isinstance(p, torch.Tensor) else torch.zeros(p, dtype=torch.uint8)
                for c in plan.chunks
                for p in c.parts
            ]
        )
        assert [c.offset for c in plan.chunks] == list(range(0, body_nbytes, chunk_bytes))
        assert all(
            c.nbytes == sum(p if isinstance(p, int) else p.numel() for p in c.parts) for c in plan.chunks
        )
        assert torch.equal(got, expected)


def _body_of_plan(plan: Any) -> torch.Tensor:
    """The body a receiver gets: each chunk as its single part sends it, or packed."""
    out = []
    for chunk in plan.chunks:
        only = chunk.parts[0] if len(chunk.parts) == 1 else None
        if isinstance(only, torch.Tensor):
            out.append(only.clone())
        elif isinstance(only, int):
            out.append(torch.zeros(only, dtype=torch.uint8))
        else:
            packed = torch.full((chunk.nbytes,), 0xEE, dtype=torch.uint8)  # not zeros: gaps must be
            _pack(chunk.parts, packed)
            out.append(packed)
    return torch.cat(out) if out else torch.empty(0, dtype=torch.uint8)


def test_storages_described_as_columns_travel_as_the_same_bytes_without_a_tensor_each() -> None:
    # The replica format's segments give offsets, sizes and addresses as columns: the plan
    # checks them in bulk and gathers small storages from raw addresses; a storage that
    # covers a whole chunk still goes as a view of itself.  Large storages spanning chunks,
    # empty ones, gaps and a zero tail, on several grids.
    gen = torch.Generator().manual_seed(5)
    sizes = [*torch.randint(1, 3000, (400,), generator=gen).tolist(), 0, 20_000, 0, 9000, 5, 70_000, 1]
    storages, offsets, offset = [], [], 0
    for n in sizes:
        storage = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).untyped_storage()
        storages.append(storage)
        offsets.append(offset)
        offset = -(-(offset + n) // 64) * 64 + (64 if n == 5 else 0)  # and one wider gap
    body_nbytes = offset + 300
    expected = torch.zeros(body_nbytes, dtype=torch.uint8)
    for at, storage in zip(offsets, storages, strict=True):
        expected[at : at + storage.nbytes()] = torch.empty(0, dtype=torch.uint8).set_(storage)
    for chunk_bytes in (4096, 8192, 1 << 20):
        columns = _StorageSegments(tuple(offsets), tuple(storages))
        plan = drive(plan_chunks(columns, body_nbytes, chunk_bytes))
        assert columns._made is None, "no uint8 tensor a storage"
        kinds = {type(c.parts[0]).__name__ for c in plan.chunks}
        assert "Gather" in kinds
        assert chunk_bytes > 20_000 or "Tensor" in kinds  # the large ones go as views
        assert torch.equal(_body_of_plan(plan), expected)
        as_tensors = drive(
            plan_chunks(list(_StorageSegments(tuple(offsets), tuple(storages))), body_nbytes, chunk_bytes)
        )
        assert torch.equal(_body_of_plan(as_tensors), expected)


def test_a_storage_resized_after_planning_is_refused_before_its_old_memory_is_read() -> None:
    # Columns carry addresses taken when the plan was made.  A staged storage must not
    # change while it is sent; one resized meanwhile has moved (its old memory may be
    # unmapped), so the packer reads every address again and refuses, naming the segment.
    storages = [torch.full((n,), i, dtype=torch.uint8).untyped_storage() for i, n in enumerate([40, 70, 30])]
    offsets = (0, 64, 192)
    plan = drive(plan_chunks(_StorageSegments(offsets, tuple(storages)), 256, 4096))
    assert isinstance(plan.chunks[0].parts[0], Gather)
    storages[1].resize_(1 << 20)
    with pytest.raises(astage.ConfigurationError, match="segment 1 changed between planning and sending"):
        _pack(plan.chunks[0].parts, torch.empty(256, dtype=torch.uint8))


class _Columns:
    """Bare columns, for the checks a column plan makes."""

    def __init__(self, offsets: list[int], sizes: list[int]) -> None:
        self.offsets, self.sizes = offsets, sizes
        self.data = torch.zeros(max(sizes, default=0) + 1, dtype=torch.uint8)

    def extents(self) -> tuple[Any, Any, Any]:
        pointers = [self.data.data_ptr()] * len(self.sizes)
        return np.array(self.offsets), np.array(self.sizes), np.array(pointers)

    def byte_tensor(self, index: int) -> torch.Tensor:
        return self.data[: self.sizes[index]]

    def extents_now(self, indices: list[int]) -> tuple[Any, Any]:
        return np.array([self.data.data_ptr()] * len(indices)), np.array([self.sizes[i] for i in indices])


@pytest.mark.parametrize(
    ("offsets", "sizes", "body", "match"),
    [
        ([0, 5], [10, 1], 20, "segment 1 at offset 5 overlaps"),
        ([0, 10, 9], [10, 0, 4], 20, "segment 2 at offset 9 overlaps"),
        ([15], [10], 20, "segment 0 ends at 25, past the body's 20 bytes"),
        ([0, -4], [1, 1], 20, "segment 1 has a negative offset or size"),
        ([0, 4], [1, -1], 20, "segment 1 has a negative offset or size"),
    ],
)
def test_bad_columns_are_refused_naming_the_segment(
    offsets: list[int], sizes: list[int], body: int, match: str
) -> None:
    with pytest.raises(astage.ConfigurationError, match=match):
        drive(plan_chunks(_Columns(offsets, sizes), body, 4096))  # type: ignore[arg-type]


def test_columns_with_an_empty_segment_inside_a_gap_are_accepted() -> None:
    # As with tensor segments: an empty one does not move the end the next must start from.
    plan = drive(plan_chunks(_Columns([0, 30, 12], [10, 0, 4]), 40, 4096))  # type: ignore[arg-type]
    (gather,) = plan.chunks[0].parts
    assert isinstance(gather, Gather)
    assert (gather.starts.tolist(), gather.sizes, gather.gaps) == ([0, 12], [10, 4], True)


def test_bad_payloads_and_arguments_are_refused_without_a_group() -> None:
    with pytest.raises(astage.ConfigurationError, match="overlaps"):
        drive(
            plan_chunks(
                [(0, torch.ones(10, dtype=torch.uint8)), (5, torch.ones(1, dtype=torch.uint8))], 20, 4096
            )
        )
    with pytest.raises(astage.ConfigurationError, match="past the body"):
        drive(plan_chunks([(15, torch.ones(10, dtype=torch.uint8))], 20, 4096))
    with pytest.raises(astage.ConfigurationError, match="uint8"):
        drive(plan_chunks([(0, torch.ones(10, dtype=torch.float32))], 40, 4096))
    with pytest.raises(astage.ConfigurationError, match="uint8"):
        drive(plan_chunks([(0, torch.ones(10, dtype=torch.uint8)[::2])], 40, 4096))
    with pytest.raises(astage.ConfigurationError, match="timeout"):
        anyio.run(lambda: send(None, Payload(b"", [], 0), to=1, timeout=-1))
    with pytest.raises(astage.ConfigurationError, match="not initialised"):
        anyio.run(lambda: send(None, Payload(b"", [], 0), to=1, timeout=1))
