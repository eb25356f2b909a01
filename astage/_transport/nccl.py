"""The NCCL wire: every message through a device bounce buffer.  Only a GPU exercises it.

Serves a ``cuda:nccl`` group without gloo.  NCCL moves device tensors only, so each message
crosses through a device bounce buffer from a small per-call pool: a message to send is
copied host-to-device on a side stream (from the loop when the host tensor is pinned, in a
worker thread otherwise) and the NCCL launch waits for that stream; a received message
lands in a bounce buffer and is copied device-to-host on a second side stream, and counts
as received once that copy has completed.  NCCL's ``Work.is_completed()`` queries the
work's CUDA end event, so completion is polled from the loop with
:func:`astage._staging.events.wait_event`'s back-off and no thread waits.  The k-th message of each
direction is launched together with the k-th of the other, as one ``batch_isend_irecv``
(:class:`~._pairing.Pairing` schedules them).  Launches run one at a time, in order, in a
worker thread: the first one on a group creates its NCCL communicator and blocks until
every rank of the group has arrived.  A group is broken with ``ProcessGroup.abort()``.
"""

from __future__ import annotations

import contextlib

import anyio
import torch
import torch.distributed as dist

from .._staging.events import Queryable, wait_event
from .._util.errors import ConfigurationError
from .._util.threads import run_sync
from .pairing import Pairing
from .wire import Message, Route

_NCCL_WINDOW = 2
"""NCCL: the same, kept small because each message in flight holds a device bounce buffer
(at most ``2 * _NCCL_WINDOW`` chunks of device memory a call)."""


class NcclWire:
    """Every message through a device bounce buffer, launched in pairs (see the module docs).

    Two side streams: ``h2d`` carries the copies into bounce buffers and is the current
    stream at each launch (so NCCL waits for those copies); ``d2h`` carries the copies out.
    A message's ``complete()`` polls its launch's works, then makes the stream that touches
    its bounce buffer next wait for them too (``Work.wait()`` on that stream), so the
    ordering holds on the device whatever the host saw.
    """

    window = _NCCL_WINDOW

    def __init__(self, route: Route) -> None:
        if not torch.cuda.is_available():
            raise ConfigurationError(
                "an NCCL process group needs CUDA, and torch.cuda.is_available() is False"
            )
        group = route.pg if route.pg is not None else dist.group.WORLD
        assert group is not None  # torch.distributed is initialised
        self.route = route
        self.group = group
        self.limiter = route.limiter
        bound = group.bound_device_id
        self.device = bound if bound is not None else torch.device("cuda", torch.cuda.current_device())
        self.h2d = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.d2h = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.pairing: Pairing[_NcclMessage] = Pairing(
            sends=route.send_to is not None, receives=route.recv_from is not None
        )
        self.launching = anyio.Lock()
        self.free: list[torch.Tensor] = []

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # Pinned, so that its copy to the device is asynchronous and issued from the loop.
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    async def expect(self, total: int, *, send: bool) -> None:
        self.pairing.expect(total, send=send)
        await self._launch_ready()

    async def post(self, tensor: torch.Tensor, tag: int, *, send: bool) -> Message:
        host = tensor.reshape(-1).view(torch.uint8)
        buffer = self.take(host.numel())
        message = _NcclMessage(self, host, buffer, send)
        if send:
            message.copied = await self.copy(buffer[: host.numel()], host, self.h2d)
        self.pairing.push(message, send=send)
        await self._launch_ready()
        return message

    def break_group(self) -> None:
        # Blocking (abort, stream synchronisation): only ever called through _Link._break,
        # which runs in a worker thread.
        # Aborting the communicator makes its kernels exit, so no launch waits any more on
        # a peer; torch keeps the bounce buffers alive until the NCCL stream is done with
        # them.  Our own copies never wait for NCCL: draining their streams is quick, and
        # afterwards no copy touches the caller's segments or body.
        with contextlib.suppress(RuntimeError):  # already aborted or destroyed
            self.group.abort()
        self.h2d.synchronize()
        self.d2h.synchronize()

    # -- device buffers and copies

    def take(self, nbytes: int) -> torch.Tensor:
        """The smallest free bounce buffer of at least ``nbytes``, or a new one."""
        fits = [i for i, b in enumerate(self.free) if b.numel() >= nbytes]
        if fits:
            return self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        # Allocated on h2d, the stream that writes it first: a block the caching allocator
        # hands out there is one no other stream may still be using.
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    async def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> Queryable | None:
        """Copy between a host tensor and a bounce buffer on ``stream``.

        Pinned host memory: issued from the loop; returns an event recorded after the copy.
        Pageable host memory: the copy blocks the thread that issues it, so it runs to its
        end in a worker thread (not abandoned on cancellation: it is one chunk); returns
        ``None``.
        """
        host = dst if dst.device.type == "cpu" else src
        if host.is_pinned():
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                copied: Queryable = stream.record_event()
            return copied
        await run_sync(_copy, dst, src, self.device, stream, limiter=self.limiter)
        return None

    # -- launching

    async def _launch_ready(self) -> None:
        """Launch every batch that can be formed, in order, one at a time."""
        async with self.launching:
            while (batch := self.pairing.pop()) is not None:
                ops = [
                    dist.P2POp(
                        dist.isend if m.send else dist.irecv,
                        m.buffer[: m.host.numel()],
                        group=self.route.pg,
                        group_peer=self.route.send_to if m.send else self.route.recv_from,
                    )
                    for m in batch
                ]
                works = await run_sync(
                    _launch, ops, self.device, self.h2d, limiter=self.limiter, abandon_on_cancel=True
                )
                if not works:
                    raise RuntimeError("the backend returned no work for a launch")
                for message in batch:
                    message.launched(works)


class _NcclMessage:
    def __init__(self, wire: NcclWire, host: torch.Tensor, buffer: torch.Tensor, send: bool) -> None:
        self.wire = wire
        self.host = host
        self.buffer = buffer
        self.send = send
        self.copied: Queryable | None = None
        self.works: list[dist.Work] = []
        self._launched = anyio.Event()

    def launched(self, works: list[dist.Work]) -> None:
        self.works = works
        self._launched.set()

    async def complete(self) -> None:
        wire = self.wire
        await self._launched.wait()
        await wait_event(_WorksDone(self.works))
        # Raise the backend's error if the launch failed, and make the stream that touches
        # this bounce buffer next wait for the launch on the device as well.
        with torch.cuda.device(wire.device), torch.cuda.stream(wire.h2d if self.send else wire.d2h):
            for work in self.works:
                work.wait()
        if self.send:
            if self.copied is not None:
                await wait_event(self.copied)  # the host tensor may be reused from here on
        else:
            copied = await wire.copy(self.host, self.buffer[: self.host.numel()], wire.d2h)
            if copied is not None:
                await wait_event(copied)
        wire.free.append(self.buffer)


class _WorksDone:
    """``wait_event`` adapter: NCCL work is complete once its CUDA end event is."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def query(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _launch(ops: list[dist.P2POp], device: torch.device, stream: torch.cuda.Stream) -> list[dist.Work]:
    # NCCL's stream waits for the current one at launch: ``stream`` (h2d) holds the copies
    # into these bounce buffers and the waits that guard their reuse.
    with torch.cuda.device(device), torch.cuda.stream(stream):
        return dist.batch_isend_irecv(ops)


def _copy(dst: torch.Tensor, src: torch.Tensor, device: torch.device, stream: torch.cuda.Stream) -> None:
    with torch.cuda.device(device), torch.cuda.stream(stream):
        dst.copy_(src)  # blocking: returns once the copy is complete
