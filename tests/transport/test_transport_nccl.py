"""The transport's NCCL wire: launch pairing and wire choice here, real NCCL groups on GPUs.

The pure parts run everywhere: which wire a backend gets, how :class:`Pairing` groups the
messages of a call into launches, and a model of NCCL's point-to-point semantics (one
stream per rank, launches in order, a send completes only while its receive runs) in
which the real ``Pairing`` schedules whole ring exchanges: paired launches always finish,
lone ones deadlock.  The GPU tests run the real thing: one GPU loops back through a group of
one rank (NCCL sends to itself inside one launch), two or more exchange along a ring.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import astage
from astage._transport import (
    CHUNK_BYTES,
    Pairing,
    Payload,
    exchange,
    exchange_ack,
    recv,
    ring_peers,
    wire_kind,
)
from tests.distributed import run_group
from tests.payloads import (
    KINDS,
    SMALL_CHUNK,
    body_of,
    check_received,
    make_payload,
    outcome,
    ring_cases,
)

# -- which wire a group gets -------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "kind"),
    [
        ("cpu:gloo,cuda:gloo", "gloo"),  # init_process_group("gloo")
        ("cpu:gloo,cuda:nccl", "gloo"),  # a mixed group: the payload is on the CPU already
        ("cuda:nccl", "nccl"),  # init_process_group("nccl")
        ("cuda:nccl,cpu:gloo", "gloo"),
        ("CUDA:NCCL", "nccl"),
    ],
)
def test_wire_kind_follows_the_backend_config(config: str, kind: str) -> None:
    assert wire_kind(config) == kind


@pytest.mark.parametrize("config", ["cpu:mpi,cuda:mpi", "cpu:fake,cuda:fake", "cuda:gloo", "cpu:ucc", ""])
def test_other_backends_are_refused(config: str) -> None:
    with pytest.raises(astage.ConfigurationError, match="needs gloo for CPU or NCCL for CUDA"):
        wire_kind(config)


def test_a_group_of_another_backend_is_refused_before_anything_is_posted() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(astage.ConfigurationError, match="'cpu:fake,cuda:fake"):
            anyio.run(lambda: exchange_ack(None, True, send_to=1, recv_from=1, timeout=1))
    finally:
        dist.destroy_process_group()


def test_gloo_refuses_a_loopback_that_only_nccl_can_do() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(astage.ConfigurationError, match="loopback needs an NCCL group"):
            anyio.run(
                lambda: exchange(
                    None, Payload(b"x", [], 0), send_to=0, recv_from=0, timeout=1, max_body_bytes=0
                )
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_nccl_wire_needs_cuda() -> None:
    from astage._transport.nccl import NcclWire
    from astage._transport.wire import Route

    with pytest.raises(astage.ConfigurationError, match="needs CUDA"):
        NcclWire(Route(None, 0, 1, 1, time.monotonic() + 1, anyio.CapacityLimiter(2)))


# -- pairing: the k-th message of each direction goes in the k-th launch ----------------


def test_messages_of_two_directions_are_launched_in_pairs_by_index() -> None:
    pairing: Pairing[str] = Pairing(sends=True, receives=True)
    pairing.push("s0", send=True)
    assert pairing.pop() is None  # the receive direction may still post its first message
    pairing.push("r0", send=False)
    pairing.push("r1", send=False)
    assert pairing.pop() == ("s0", "r0")
    assert pairing.pop() is None
    pairing.expect(1, send=True)  # the send direction is done: r1 goes alone
    assert pairing.pop() == ("r1",)
    assert pairing.pop() is None


def test_a_direction_that_announced_its_count_closes_when_it_has_posted_it() -> None:
    pairing: Pairing[str] = Pairing(sends=True, receives=True)
    pairing.expect(2, send=True)
    pairing.push("s0", send=True)
    pairing.push("s1", send=True)
    pairing.push("r0", send=False)
    assert pairing.pop() == ("s0", "r0")
    assert pairing.pop() is None  # r1 may come
    pairing.expect(1, send=False)
    assert pairing.pop() == ("s1",)
    with pytest.raises(RuntimeError, match="more than it announced"):
        pairing.push("s2", send=True)
    with pytest.raises(RuntimeError, match="announced 0 messages after posting 1"):
        pairing.expect(0, send=False)


def test_a_one_way_call_launches_each_message_alone() -> None:
    sends: Pairing[int] = Pairing(sends=True, receives=False)
    receives: Pairing[int] = Pairing(sends=False, receives=True)
    for i in range(3):
        sends.push(i, send=True)
        receives.push(i, send=False)
    assert [sends.pop(), sends.pop(), sends.pop(), sends.pop()] == [(0,), (1,), (2,), None]
    assert [receives.pop(), receives.pop(), receives.pop(), receives.pop()] == [(0,), (1,), (2,), None]


# -- a model of NCCL point-to-point, driven by the real Pairing -------------------------

Op = tuple[bool, int]
"""(send?, message index) of one rank's direction."""


@dataclass
class ModelRank:
    """One rank as ``_send`` and ``_receive`` drive it: windows, and launches in order."""

    sends: int
    receives: int
    window: int
    paired: bool
    pairing: Pairing[Op] = field(init=False)
    launches: list[tuple[Op, ...]] = field(default_factory=list)
    done: int = 0  # launches completed, in order (one NCCL stream)
    posted: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    retired: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    completed: set[Op] = field(default_factory=set)
    receives_known: bool = False

    def __post_init__(self) -> None:
        self.pairing = Pairing(sends=True, receives=True)
        self.pairing.expect(self.sends, send=True)  # _send knows its plan up front

    def host_step(self) -> bool:
        """Post what the directions may post now; launch what the pairing releases."""
        progress = False
        for send in (True, False):
            while self.retired[send] < self.posted[send] and (send, self.retired[send]) in self.completed:
                self.retired[send] += 1  # each direction waits for its oldest message
        if not self.receives_known and (False, 0) in self.completed:
            self.receives_known = True  # the preamble has landed: the count is known
            self.pairing.expect(self.receives, send=False)
            progress = True
        for send, total in ((True, self.sends), (False, self.receives)):
            k, retired = self.posted[send], self.retired[send]
            if k >= total:
                continue
            if send:  # preamble and prefix at once, then chunks within the window
                may = k < 2 or k - retired < self.window
            else:  # preamble, then prefix, each awaited; then chunks within the window
                may = k == 0 or (
                    self.receives_known and (retired == k if k < 2 else k - retired < self.window)
                )
                may = may and (k < 2 or retired >= 2)
            if may:
                self.posted[send] += 1
                if self.paired:
                    self.pairing.push((send, k), send=send)
                else:
                    self.launches.append(((send, k),))
                progress = True
        while (batch := self.pairing.pop()) is not None:
            self.launches.append(batch)
        return progress

    def head(self) -> tuple[Op, ...] | None:
        return self.launches[self.done] if self.done < len(self.launches) else None


def model_ring(world: int, offset: int, sizes: list[int], *, window: int, paired: bool) -> bool:
    """Run a ring exchange in the model; True when every message lands, False on deadlock."""
    peers = [ring_peers(r, world, offset) for r in range(world)]
    ranks = [ModelRank(sizes[r], sizes[peers[r][1]], window=window, paired=paired) for r in range(world)]
    while True:
        host = [rank.host_step() for rank in ranks]
        # The launches running now: each rank's oldest.  Keep those whose every message
        # meets its counterpart among the kept ones (a send and its receive run together).
        running = {r for r, rank in enumerate(ranks) if rank.head() is not None}
        changed = True
        while changed:
            changed = False
            for r in sorted(running):
                for send, k in ranks[r].head() or ():
                    peer = peers[r][0] if send else peers[r][1]
                    if peer not in running or (not send, k) not in (ranks[peer].head() or ()):
                        running.discard(r)
                        changed = True
                        break
        for r in running:
            ranks[r].completed.update(ranks[r].head() or ())
            ranks[r].done += 1
        if all(len(rank.completed) == rank.sends + rank.receives for rank in ranks):
            return True
        if not running and not any(host):
            return False


def test_the_model_deadlocks_without_pairing() -> None:
    """NCCL's known trap, reproduced: each rank launches its send before its receive."""
    assert not model_ring(2, 1, [3, 3], window=2, paired=False)


@pytest.mark.parametrize(("world", "offset"), [(2, 1), (3, 1), (3, 2), (4, 2), (4, 1), (4, 3), (5, 2)])
@pytest.mark.parametrize("window", [1, 2, 4])
def test_paired_launches_finish_every_ring_whatever_the_sizes(world: int, offset: int, window: int) -> None:
    for sizes in itertools.islice(itertools.product([1, 2, 3, 7], repeat=world), 200):
        assert model_ring(world, offset, list(sizes), window=window, paired=True), sizes


@settings(max_examples=200, deadline=None)
@given(
    world=st.integers(2, 6),
    data=st.data(),
    window=st.integers(1, 4),
)
def test_paired_launches_finish_random_rings(world: int, data: st.DataObject, window: int) -> None:
    offset = data.draw(st.integers(1, world - 1))
    sizes = data.draw(st.lists(st.integers(1, 12), min_size=world, max_size=world))
    assert model_ring(world, offset, sizes, window=window, paired=True)


# -- real NCCL groups (GPU only) --------------------------------------------------------

TIMEOUT = 2.0


def pinned_payload(rank: int) -> Payload:
    """``make_payload(rank, "big")`` with its segments in pinned memory (the async copy path)."""
    payload = make_payload(rank, "big")
    return Payload(payload.prefix, [(o, t.pin_memory()) for o, t in payload.segments], payload.body_nbytes)


async def heartbeat_during(call: Callable[[], Coroutine[Any, Any, object]]) -> float:
    """Run ``call`` while a 5 ms heartbeat ticks; return the longest gap between ticks."""
    gaps: list[float] = []
    async with anyio.create_task_group() as tg:

        async def tick() -> None:
            last = time.perf_counter()
            while True:
                await anyio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tg.start_soon(tick)
        await call()
        tg.cancel_scope.cancel()
    return max(gaps, default=0.0)


async def loopback(rank: int, world: int) -> dict[str, Any]:
    """One rank, one GPU: every message goes to this rank itself through NCCL."""
    out: dict[str, Any] = {"backend": dist.get_backend()}
    # Every kind, at a small chunk (many launches) and at the default one.
    out["kinds"] = await ring_cases_loopback(KINDS, SMALL_CHUNK)
    out["kinds"] += await ring_cases_loopback(("big",), CHUNK_BYTES)

    # Pinned segments and a pinned body: the copies are issued from the loop and awaited
    # as events; chunks still arrive in order, final, while later ones fly.
    expected = body_of(make_payload(0, "big"))
    seen: list[int] = []

    async def on_chunk(offset: int, chunk: torch.Tensor) -> None:
        assert chunk.numpy().tobytes() == expected[offset : offset + chunk.numel()]
        seen.append(offset)

    got = await exchange(
        None,
        pinned_payload(0),
        send_to=0,
        recv_from=0,
        timeout=30,
        max_body_bytes=8 << 20,
        chunk_bytes=SMALL_CHUNK,
        allocate=lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True),
        on_chunk=on_chunk,
    )
    check_received(got, 0, "big")
    out["pinned_in_order"] = seen == list(range(0, len(expected), SMALL_CHUNK))

    # The loop keeps ticking while 64 MiB go round.
    big = Payload(b"", [(0, torch.full((64 << 20,), 3, dtype=torch.uint8))], 64 << 20)
    out["max_gap"] = await heartbeat_during(
        lambda: exchange(None, big, send_to=0, recv_from=0, timeout=30, max_body_bytes=64 << 20)
    )

    # Acknowledgements: this rank tells itself that it could not keep the replica.
    out["ack_ok"] = await outcome(exchange_ack(None, True, send_to=0, recv_from=0, timeout=10))
    out["ack_failed"] = await outcome(
        exchange_ack(None, False, send_to=0, recv_from=0, timeout=10, message="disk full (ENOSPC)")
    )

    # A receive that nothing will match times out, and aborts only its own group.
    sub = dist.new_group([0])
    started = time.monotonic()
    out["silent"] = await outcome(recv(sub, from_=0, timeout=TIMEOUT, max_body_bytes=1 << 20))
    out["silent_after"] = time.monotonic() - started
    out["still_healthy"] = await ring_cases_loopback(("big",), SMALL_CHUNK)
    return out


async def ring_cases_loopback(kinds: tuple[str, ...], chunk_bytes: int) -> list[tuple[int, int]]:
    moved = []
    for kind in kinds:
        got = await exchange(
            None,
            make_payload(0, kind),
            send_to=0,
            recv_from=0,
            timeout=30,
            max_body_bytes=8 << 20,
            chunk_bytes=chunk_bytes,
        )
        check_received(got, 0, kind)
        moved.append((got.stats.bytes_sent, got.stats.bytes_received))
    return moved


@pytest.mark.gpu
def test_one_gpu_loops_back_through_nccl_bit_exact() -> None:
    (result,) = run_group(1, loopback, pg_backend="nccl", timeout=120)
    out = result.unwrap()
    assert out["backend"] == "nccl"
    assert all(sent == received for sent, received in out["kinds"])
    assert out["pinned_in_order"]
    assert out["max_gap"] < 0.25
    assert out["ack_ok"] == "ok"
    assert out["ack_failed"] == "PeerReportedError: rank 0 reports failure: disk full (ENOSPC)"
    assert out["silent"].startswith(("PeerTimeoutError: ", "TransportError: ")), out["silent"]
    assert out["silent_after"] < TIMEOUT + 1.0
    assert out["still_healthy"]


def needs_gpus(world: int) -> Any:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(
        count < world,
        reason=f"NCCL needs a distinct GPU per rank: {world} ranks, {count} GPU(s) here",
    )


async def ring_over_nccl(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"moved": await ring_cases(None, None, KINDS)}
    out["moved"] += await ring_cases(None, None, ("big",), chunk_bytes=CHUNK_BYTES)
    out["pinned"] = await ring_cases_pinned(rank, world)
    # Acknowledgements run backwards along the ring: rank 1 could not keep its replica.
    send_to, recv_from = ring_peers(rank, world)
    ok = rank != 1
    out["ack"] = await outcome(
        exchange_ack(
            None, ok, send_to=send_to, recv_from=recv_from, timeout=10, message="" if ok else "fsync: EIO"
        )
    )
    out["send_to"], out["recv_from"] = send_to, recv_from
    return out


async def ring_cases_pinned(rank: int, world: int) -> bool:
    send_to, recv_from = ring_peers(rank, world)
    got = await exchange(
        None,
        pinned_payload(rank),
        send_to=send_to,
        recv_from=recv_from,
        timeout=30,
        max_body_bytes=8 << 20,
        chunk_bytes=SMALL_CHUNK,
        allocate=lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True),
    )
    check_received(got, recv_from, "big")
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("world", [pytest.param(w, marks=needs_gpus(w)) for w in (2, 3, 4)])
def test_ranks_on_their_own_gpus_exchange_along_the_ring(world: int) -> None:
    out = [r.unwrap() for r in run_group(world, ring_over_nccl, pg_backend="nccl", timeout=120)]
    for rank, result in enumerate(out):
        sender = result["recv_from"]
        assert [s for s, _ in out[sender]["moved"]] == [r for _, r in result["moved"]]
        assert result["pinned"]
        # Rank 1 could not keep its replica: the rank that sent it (whose send_to is 1) hears.
        if result["send_to"] == 1:
            assert result["ack"] == "PeerReportedError: rank 1 reports failure: fsync: EIO"
        else:
            assert result["ack"] == "ok", (rank, result["ack"])


async def silent_peer(rank: int, world: int) -> tuple[str, float]:
    if rank == 1:
        await anyio.sleep(TIMEOUT + 1.5)  # takes no part: rank 0's launches never match
        return "silent", 0.0
    started = time.monotonic()
    payload = Payload(b"x", [(0, torch.ones(1 << 20, dtype=torch.uint8))], 1 << 20)
    result = await outcome(
        exchange(None, payload, send_to=1, recv_from=1, timeout=TIMEOUT, max_body_bytes=1 << 20)
    )
    return result, time.monotonic() - started


@pytest.mark.gpu
@needs_gpus(2)
def test_a_silent_peer_times_out_over_nccl_and_the_group_is_aborted() -> None:
    results = run_group(2, silent_peer, pg_backend="nccl", timeout=60)
    message, elapsed = results[0].unwrap()
    assert message.startswith("PeerTimeoutError: rank 0: "), message
    assert TIMEOUT - 0.05 <= elapsed < TIMEOUT + 1.0
