"""The gloo calls on the calling thread: an exchange that needs no event loop.

A Checkpointer runs a save's background half in a worker thread of its own, so that it
progresses while the program holds the event loop (a synchronous training step); the
replication exchange is part of that half, and the peer's loop may be held as well.  The
async calls (:mod:`._exchange`) hand every message's wait to a worker thread and back to
the loop; these run the same protocol (:mod:`._protocol`: preamble, prefix, body chunks on
the same grid, the same tags, acknowledgements both ways at once) with blocking gloo waits:
the receiving direction on the calling thread, the sending one on a daemon thread.

Invariants (as the async calls'):

* The whole call honours the deadline: a gloo wait is given the time left, and a
  timed-out wait is :class:`PeerTimeoutError`.
* Pending point-to-point work cannot be cancelled: when a direction fails after anything
  was posted, the group is broken on purpose (a 1 ms timed-out receive), so that the other
  direction's waits fail at once and the peers see it at once.  :meth:`BlockingLink.interrupt`
  does the same from another thread (the save was abandoned).
* Buffers are reused or released only once the call has returned: every wait has ended.

Gloo only: NCCL's completions are polled from the loop (:mod:`._nccl`).
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .._util.errors import ConfigurationError, PeerReportedError, PeerTimeoutError, TransportError
from .._util.timeslice import drive
from .exchange import PackBuffers, _allocate_body, _pack, direct_tensor
from .protocol import (
    ACK_BYTES,
    ACK_TAG,
    BODY_TAG,
    BREAK_TAG,
    MAX_PREFIX_BYTES,
    PREAMBLE_TAG,
    PREAMBLE_WORDS,
    PREFIX_TAG,
    ChunkPlan,
    Limits,
    Payload,
    check_preamble,
    decode_ack,
    encode_ack,
    plan_chunks,
    preamble_words,
    wire_kind,
)

_WINDOW = 4
"""Chunks posted ahead of the one being waited for, per direction (as the gloo wire)."""


def _host_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


OnPrefixSync = Callable[[bytes], None]
OnChunkSync = Callable[[int, torch.Tensor], None]


def supports(pg: dist.ProcessGroup | None) -> bool:
    """Whether ``pg`` can be driven from a thread with no event loop (its CPU backend is gloo)."""
    try:
        return wire_kind(dist.get_backend_config(pg)) == "gloo"
    except (ConfigurationError, RuntimeError, ValueError):
        return False


class BlockingLink:
    """One blocking call's view of the group: peers, deadline, progress and breakage."""

    def __init__(
        self,
        pg: dist.ProcessGroup | None,
        deadline: float,
        *,
        send_to: int | None = None,
        recv_from: int | None = None,
        on_posted: Callable[[], None] | None = None,
    ) -> None:
        self.pg = pg
        self.rank = dist.get_rank(pg)
        self.deadline = deadline  # time.monotonic()
        self.send_to = send_to
        self.recv_from = recv_from
        self.on_posted = on_posted
        self.posted = False
        self.broken = False
        self.interrupted = False
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.prefix = b""
        self.body: torch.Tensor | None = None
        self.peer_failure: str | None = None

    def _posting(self) -> None:
        with self._lock:
            if self.interrupted:
                raise TransportError(
                    f"rank {self.rank}: the exchange was interrupted (its save was abandoned)"
                )
            first, self.posted = not self.posted, True
        if first and self.on_posted is not None:
            self.on_posted()

    def post(self, tensor: torch.Tensor, tag: int, *, send: bool) -> dist.Work:
        self._posting()
        try:
            if send:
                work = dist.isend(tensor, group=self.pg, group_dst=self.send_to, tag=tag)
            else:
                work = dist.irecv(tensor, group=self.pg, group_src=self.recv_from, tag=tag)
        except RuntimeError as exc:
            raise self._translate(exc, send=send) from exc
        if work is None:
            raise ConfigurationError("this rank is not a member of the process group")
        return work

    def wait(self, work: dist.Work, *, send: bool) -> None:
        """Wait for ``work`` until the deadline (a zero timedelta means none to c10d: >= 1 ms)."""
        remaining = max(self.deadline - time.monotonic(), 1e-3)
        try:
            done = work.wait(timedelta(seconds=remaining))
        except RuntimeError as exc:
            raise self._translate(exc, send=send) from exc
        if not done:
            raise self._translate(RuntimeError("the backend aborted the operation"), send=send)

    def interrupt(self) -> None:
        """Break the group if this call has posted anything (any thread): every pending
        wait fails at once, here and at the peers."""
        with self._lock:
            self.interrupted = True
            if not self.posted or self.broken:
                return
            self.broken = True
        peer = self.recv_from if self.recv_from is not None else self.send_to
        probe = torch.empty(1, dtype=torch.uint8)
        try:
            work = dist.irecv(probe, group=self.pg, group_src=peer, tag=BREAK_TAG)
            if work is not None:
                work.wait(timedelta(milliseconds=1))
        except (RuntimeError, ValueError):
            pass  # the expected timeout, or a group already broken or destroyed

    def _translate(self, exc: RuntimeError, *, send: bool) -> TransportError:
        what = f"rank {self.rank}: " + (
            f"sending to rank {self.send_to}" if send else f"receiving from rank {self.recv_from}"
        )
        text = str(exc).strip()
        text = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]) if text else type(exc).__name__
        if "timed out" in text.lower():
            return PeerTimeoutError(f"{what}: {text}")
        return TransportError(f"{what}: {text}")

    def run(self, *directions: Callable[[], None]) -> None:
        """Run the directions at once (the first here, the others on daemon threads); break
        the group and raise the first error if one fails."""
        errors: list[BaseException] = []

        def guarded(direction: Callable[[], None]) -> None:
            try:
                direction()
            except BaseException as exc:
                errors.append(exc)
                self.interrupt()  # the other direction's waits fail at once

        helpers = [
            threading.Thread(target=guarded, args=(d,), name="astage transport", daemon=True)
            for d in directions[1:]
        ]
        for helper in helpers:
            helper.start()
        guarded(directions[0])
        for helper in helpers:
            helper.join()
        if errors:
            self.interrupt()
            raise errors[0]


def _send(link: BlockingLink, prefix: bytes, plan: ChunkPlan) -> None:
    body_nbytes = sum(c.nbytes for c in plan.chunks)
    preamble = torch.tensor(preamble_words(len(prefix), body_nbytes, plan.chunk_bytes), dtype=torch.int64)
    inflight: deque[tuple[dist.Work, torch.Tensor, torch.Tensor | None]] = deque()
    inflight.append((link.post(preamble, PREAMBLE_TAG, send=True), preamble, None))
    if prefix:
        blob = torch.frombuffer(bytearray(prefix), dtype=torch.uint8)
        inflight.append((link.post(blob, PREFIX_TAG, send=True), blob, None))
        link.bytes_sent += len(prefix)
    buffers = PackBuffers(_host_buffer, min(plan.chunk_bytes, body_nbytes))

    def retire_oldest() -> None:
        work, _, buffer = inflight.popleft()
        link.wait(work, send=True)
        buffers.give_back(buffer)

    for chunk in plan.chunks:
        buffer = None
        tensor = direct_tensor(chunk)
        if tensor is None:
            while not buffers.ready:
                retire_oldest()
            buffer, tensor = buffers.take(chunk.nbytes)
            _pack(chunk.parts, tensor)
        while len(inflight) >= _WINDOW:
            retire_oldest()
        inflight.append((link.post(tensor, BODY_TAG, send=True), tensor, buffer))
        link.bytes_sent += chunk.nbytes
    while inflight:
        retire_oldest()


def _receive(
    link: BlockingLink,
    limits: Limits,
    on_prefix: OnPrefixSync | None,
    on_chunk: OnChunkSync | None,
) -> None:
    preamble = torch.zeros(PREAMBLE_WORDS, dtype=torch.int64)
    link.wait(link.post(preamble, PREAMBLE_TAG, send=False), send=False)
    assert link.recv_from is not None
    prefix_len, body_nbytes, chunk_bytes = check_preamble(preamble.tolist(), link.recv_from, limits)
    prefix = torch.empty(prefix_len, dtype=torch.uint8)
    if prefix_len:
        link.wait(link.post(prefix, PREFIX_TAG, send=False), send=False)
        link.bytes_received += prefix_len
    link.prefix = prefix.numpy().tobytes()
    if on_prefix is not None:
        on_prefix(link.prefix)
    body = _allocate_body(limits.allocate, body_nbytes)
    offsets = range(0, body_nbytes, chunk_bytes)
    inflight: deque[dist.Work] = deque()
    for offset in offsets[:_WINDOW]:
        inflight.append(link.post(body[offset : offset + chunk_bytes], BODY_TAG, send=False))
    for i, offset in enumerate(offsets):
        link.wait(inflight.popleft(), send=False)
        if i + _WINDOW < len(offsets):
            ahead = offsets[i + _WINDOW]
            inflight.append(link.post(body[ahead : ahead + chunk_bytes], BODY_TAG, send=False))
        chunk = body[offset : offset + chunk_bytes]
        link.bytes_received += chunk.numel()
        if on_chunk is not None:
            on_chunk(offset, chunk)
    link.body = body


def exchange(
    link: BlockingLink,
    payload: Payload,
    *,
    chunk_bytes: int,
    max_body_bytes: int,
    allocate: Callable[[int], torch.Tensor] | None = None,
    on_prefix: OnPrefixSync | None = None,
    on_chunk: OnChunkSync | None = None,
) -> tuple[bytes, torch.Tensor]:
    """Send ``payload`` to ``link.send_to`` while receiving a replica from ``link.recv_from``.

    :returns: the peer's prefix and body.
    :raises: as :func:`astage._transport.exchange`.
    """
    plan = drive(plan_chunks(payload.segments, payload.body_nbytes, chunk_bytes))
    limits = Limits(max_body_bytes, MAX_PREFIX_BYTES, allocate, None, None)
    link.run(
        lambda: _receive(link, limits, on_prefix, on_chunk),
        lambda: _send(link, payload.prefix, plan),
    )
    assert link.body is not None
    return link.prefix, link.body


def exchange_ack(link: BlockingLink, ok: bool, message: str = "") -> None:
    """Tell ``link.send_to`` (the rank whose replica we hold) whether it is durable here while
    hearing from ``link.recv_from`` (our holder) whether ours is, both at once.

    :raises PeerReportedError: the holder reports failure; the group is still healthy.
    """
    sent = torch.frombuffer(encode_ack(ok, message), dtype=torch.uint8)
    heard = torch.zeros(ACK_BYTES, dtype=torch.uint8)

    def send() -> None:
        link.wait(link.post(sent, ACK_TAG, send=True), send=True)

    def receive() -> None:
        link.wait(link.post(heard, ACK_TAG, send=False), send=False)
        assert link.recv_from is not None
        link.peer_failure = decode_ack(heard.numpy().tobytes(), link.recv_from)

    link.run(receive, send)
    if link.peer_failure is not None:
        raise PeerReportedError(link.peer_failure)
