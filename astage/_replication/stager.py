"""ReplicationStager: keep a durable copy of a peer rank's state on this rank's disk.

Each ``replicate()`` stages this rank's state (the core machinery), lays it out in the
replica format, exchanges it with the ring peers over ``torch.distributed`` (send to
``(r + k) % W``, receive from ``(r - k) % W``), writes the received replica to a temp file
and checks its checksums as its chunks land, makes it durable (fsync, atomic replace,
directory fsync), and then both sides acknowledge, so that neither reports success unless
its peer holds its replica durably.

Invariants:

* Calls are serialised per stager: the ranks' messages of one call never interleave with
  another's.  Every rank of the group must call ``replicate`` the same number of times.
* The whole call honours ``timeout``: a peer that dies or hangs is an astage error within
  ``timeout`` (plus the time to break the group), never a hang, and never a partial or
  unverified replica under its final name (the previous one stays).
* Each call walks the protocol's phases (:class:`ReplicationPhase`): staged → posted → exchanged →
  acknowledged.  A failure while *posted* or *exchanged* leaves the ranks out of step, and
  the transport breaks the group on purpose (see ``astage._transport``): the stager then
  refuses further exchanges with a clear error, while its local staging works.  A failure
  while *staged* (nothing on the wire yet) or once *acknowledged* (both sides agreed on
  the outcome) leaves the group usable.
* Every constructor argument is checked in ``__init__``: a bad value never reaches the
  wire, where it would cost the group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Self

import anyio
import anyio.abc
import torch
import torch.distributed as dist

from .. import _transport
from .._files.durable import (
    blocking_io,
    make_dirs_durable,
    replica_path,
    sweep_stale_temps,
)
from .._format.codec import (
    Encoded,
    FileHeader,
    FileLayout,
    decode,
    parse_prefix,
)
from .._format.header_cache import HeaderCache
from .._format.layouts import LayoutCache
from .._staging.options import StagingOptions, coerce_options
from .._staging.pool import BufferKind, BufferPool, PoolStats
from .._staging.stager import DefaultStager, StageStats
from .._staging.torch_api import refuse_torch_caller
from .._transport import blocking
from .._util.errors import (
    ClosedError,
    ConfigurationError,
    IntegrityError,
    PeerReportedError,
    TransportError,
    one_error,
)
from .._util.errors import describe as _describe
from .._util.limits import INT64
from .._util.threads import run_sync
from .._util.validate import check_int, check_path, check_seconds
from .records import (
    GroupSession,
    ReplicationPhase,
    ReplicationResult,
    ReplicationStats,
    received_result,
    time_left,
)
from .replicas import held_replica_paths, read_replica_file
from .sink import BlockingSink, StreamingSink, unlink_if_present

if TYPE_CHECKING:
    from torch.distributed.checkpoint.staging import StagingOptions as TorchStagingOptions

log = logging.getLogger("astage.replication")

DEFAULT_MAX_REPLICA_BYTES = 1 << 40
"""Largest replica accepted from a peer unless told otherwise (checked before allocating)."""
_MAX_BYTES = INT64 - 1
"""Sizes (and steps) travel as int64."""


def _check_call(step: object, checkpoint_id: object) -> None:
    # Checked before staging; the format checks the rest (the id's length) while encoding.
    check_int("step", step, lo=-(_MAX_BYTES + 1), hi=_MAX_BYTES)
    if checkpoint_id is not None and not isinstance(checkpoint_id, str):
        raise ConfigurationError(
            f"checkpoint_id must be a str or None, got {type(checkpoint_id).__qualname__}"
        )


def _check_choices(
    peer_offset: object, stager: object, options: object, process_group: object, keep: object
) -> None:
    """The constructor's checks of the arguments that pick among alternatives."""
    if peer_offset is not None and type(peer_offset) is not int:
        raise ConfigurationError(f"peer_offset must be an int or None, got {peer_offset!r}")
    if stager is not None and not isinstance(stager, DefaultStager):
        raise ConfigurationError(
            f"stager must be an astage DefaultStager (or a subclass), got {type(stager).__qualname__}"
        )
    if stager is not None and options is not None:
        raise ConfigurationError("pass options or stager, not both: options configure the default stager")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise ConfigurationError(
            "process_group must be a torch.distributed.ProcessGroup or None, "
            f"got {type(process_group).__qualname__}"
        )
    if keep is not None and (type(keep) is not int or keep < 1):
        raise ConfigurationError(f"keep must be an int >= 1 or None, got {keep!r}")


class ReplicationStager(anyio.abc.AsyncResource):
    """Stage, exchange with a ring peer, and persist the peer's replica durably.

    ::

        async with astage.ReplicationStager(storage_dir="/local/replicas", timeout=60) as rs:
            result = await rs.replicate(model.state_dict(), step=step)
            result.replica_path          # the peer's state, durable on this rank's disk

    ``await rs.stage(sd)`` does the same and returns this rank's staged copy, so a
    ReplicationStager is usable wherever an :class:`AsyncStager` is.

    Received replicas land in buffers the stager keeps and reuses once nothing references
    the replica of an earlier result.  The replica file a call replaces is deleted by the
    next call (while it stages) or by :meth:`aclose`, not by the call itself.

    :param process_group: the group to replicate in (default: the default group); ranks are
        taken in its rank space, so subgroups work.
    :param storage_dir: where received replicas are kept (created 0700).
    :param timeout: seconds (or a timedelta) for one whole exchange.
    :param peer_offset: ring step k (default ``W // 2``).
    :param stager: the stager for this rank's state (default: a DefaultStager it owns).
    :param options: options for the default stager (an astage or a torch
        ``StagingOptions``); not with ``stager``.
    :param max_replica_bytes: largest replica accepted from a peer.
    :param chunk_bytes: size of the body messages sent, in
        ``[astage._transport.MIN_CHUNK_BYTES, MAX_CHUNK_BYTES]`` (4 KiB to 1 GiB).
    :param keep: ``None`` (default): one replica file per owner, each call replacing it.  An
        int: one file per step (``...-step{step:010d}.astage``), keeping the ``keep`` highest
        steps, so that a :class:`Checkpointer` with the same ``keep`` can restore any of its
        committed steps collectively (see ``Checkpointer.restore``).
    :raises ConfigurationError: any argument of the wrong type or out of range (named), no
        initialised process group, a rank outside ``process_group``, a group of one rank,
        an offset that maps a rank to itself, or a backend the transport cannot drive.
    """

    accepts_encoded: ClassVar[bool] = True
    """:meth:`replicate_staged` takes ``encoded=``: a Checkpointer hands it the encoding it
    writes locally, so a save is encoded once (the optional capability of ``Replicator``)."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        *,
        storage_dir: str | os.PathLike[str],
        timeout: float | timedelta = 300.0,
        peer_offset: int | None = None,
        stager: DefaultStager | None = None,
        options: StagingOptions | TorchStagingOptions | None = None,
        max_replica_bytes: int = DEFAULT_MAX_REPLICA_BYTES,
        chunk_bytes: int = _transport.CHUNK_BYTES,
        keep: int | None = None,
    ) -> None:
        # The plain arguments first, so that their errors do not depend on the group.
        self.storage_dir = check_path("storage_dir", storage_dir)
        self.timeout = check_seconds("timeout", timeout)
        self.max_replica_bytes = check_int("max_replica_bytes", max_replica_bytes, lo=1, hi=_MAX_BYTES)
        self.chunk_bytes = check_int(
            "chunk_bytes", chunk_bytes, lo=_transport.MIN_CHUNK_BYTES, hi=_transport.MAX_CHUNK_BYTES
        )
        _check_choices(peer_offset, stager, options, process_group, keep)
        resolved_options = coerce_options(options)
        self.keep = keep
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigurationError("ReplicationStager needs an initialised torch.distributed process group")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        if self.rank < 0:
            raise ConfigurationError("this rank is not a member of process_group")
        self.send_to, self.recv_from = _transport.ring_peers(self.rank, self.world_size, peer_offset)
        _transport.wire_kind(dist.get_backend_config(process_group))
        self._owns_stager = stager is None
        self.stager = stager if stager is not None else DefaultStager(resolved_options)
        # Received replicas land in buffers reused from call to call (no page faults in
        # the steady state); one comes back once nothing references its replica.
        self._inbox = BufferPool(BufferKind.PLAIN)
        # A repeated structure is laid out once (as Checkpointer.save does).
        self._layouts = LayoutCache(self.rank)
        # And the peer's repeated structure is parsed once (its plan kept: astage._format.header_cache).
        self._headers = HeaderCache()
        # Replicas replaced on disk, still to delete (see _retire_previous).
        self._retired: list[Path] = []
        self._lock: anyio.Lock | None = None
        self._started = False
        # What broke the group, as text: keeping the exception would keep its traceback's
        # frames, whose locals view the staged buffers, so the pool could never reclaim them.
        self._broken: str | None = None
        self._phase = ReplicationPhase.ACKNOWLEDGED  # as if after a completed call: nothing pending
        self._closed = False
        # The Checkpointer's worker-thread path (replicate_blocking): one call at a time, the
        # link in flight (to break it when the save is abandoned), a body buffer re-used.
        self._thread_lock = threading.Lock()
        self._live: blocking.BlockingLink | None = None
        self._thread_body: torch.Tensor | None = None

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        await self._start()
        return self

    async def _start(self) -> None:
        if self._started:
            return
        self._started = True
        # Every missing directory, parents included, is made 0700 like the Checkpointer's.
        await blocking_io(make_dirs_durable, self.storage_dir)
        swept = await blocking_io(sweep_stale_temps, self.storage_dir)
        if swept:
            log.info("swept %d stale temp file(s) from %s", len(swept), self.storage_dir)

    async def aclose(self) -> None:
        """Close the stager it owns (replicas on disk are kept); idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._delete_retired()
        await self._inbox.aclose()
        if self._owns_stager:
            await self.stager.aclose()

    # -- replicating --------------------------------------------------------------------------

    @refuse_torch_caller
    async def stage(self, state_dict: Any) -> Any:
        """Replicate ``state_dict`` (see :meth:`replicate`) and return this rank's staged copy.

        Unlike torch's ``_ReplicationStager.stage``, which returns the *received* replica,
        this keeps the stager contract (a training-safe copy of ``state_dict``), so that it
        can stand wherever a stager does; the peer's state is ``replicate(...).replica``.
        """
        return (await self.replicate(state_dict)).staged

    async def replicate(
        self, state_dict: Any, *, step: int = 0, checkpoint_id: str | None = None
    ) -> ReplicationResult:
        """Stage ``state_dict``, exchange it with the peers, persist the peer's replica.

        :raises UnsupportedInputError: a value that cannot be staged or replicated (key path).
        :raises PeerTimeoutError: the exchange did not finish within ``timeout``.
        :raises TransportError: the peer failed, or reports that it could not persist ours.
        :raises IntegrityError: the peer's replica is malformed or corrupt.
        :raises PersistError: the peer's replica could not be written; the previous is kept.
        :raises ClosedError: the stager is closed.
        :raises ConfigurationError: ``step`` or ``checkpoint_id`` of the wrong type (before
            anything is staged).
        """
        self._check_usable()
        _check_call(step, checkpoint_id)
        with one_error():  # the stager's error as it is, not in a group
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._delete_retired)  # while staging, off the critical path
                # This call's own stats: ``stager.last_stats`` is the latest stage's, which a
                # concurrent call may have replaced by the time this one reads it.
                staged, stage_stats = await self.stager.stage_with_stats(state_dict)
        try:
            return await self._replicate(staged, step, checkpoint_id, stage_stats)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.stager.release(staged)
            raise

    async def replicate_staged(
        self,
        staged: Any,
        *,
        step: int = 0,
        checkpoint_id: str | None = None,
        encoded: Encoded | None = None,
    ) -> ReplicationResult:
        """Like :meth:`replicate` for a state_dict that is already staged (CPU tensors).

        ``staged`` must not change until this returns.

        :param encoded: ``staged`` already encoded (by :func:`astage._format.codec.encode`, with
            this ``step`` and ``checkpoint_id``): its body and checksums are sent as they are,
            only its prefix is made again with this rank's ranks.  The Checkpointer passes
            the one it writes locally, so that a save is encoded once.
        :raises ConfigurationError: ``encoded`` was made for another step or checkpoint id,
            or not by ``encode``.
        """
        self._check_usable()
        _check_call(step, checkpoint_id)
        if encoded is not None and (
            encoded.layout is None
            or checkpoint_id is None
            or (encoded.layout.step, encoded.layout.checkpoint_id) != (step, checkpoint_id)
        ):
            raise ConfigurationError(
                "encoded must come from encode() with the same step and checkpoint_id as this call"
            )
        return await self._replicate(staged, step, checkpoint_id, None, encoded)

    # -- the Checkpointer's worker-thread path ---------------------------------------------

    def can_replicate_blocking(self) -> bool:
        """Whether :meth:`replicate_blocking` can drive this stager's group (gloo)."""
        return blocking.supports(self.process_group)

    def replicate_blocking(
        self, *, step: int, checkpoint_id: str, encoded: Encoded, started: Callable[[], None] | None = None
    ) -> None:
        """:meth:`replicate_staged` on the calling thread, which need not be the event loop's.

        The Checkpointer calls it from a save's worker thread, so that the exchange
        progresses while the program holds the event loop (and the peer's may be held too):
        the same protocol, phases, checks and durability as :meth:`replicate_staged`, with
        blocking gloo waits.  Only one call at a time; not mixed with concurrent async calls.
        :meth:`interrupt` breaks a call in flight (the save was abandoned).

        :param encoded: this save's encoding (owner this rank, no holder), relabelled here.
        :param started: called once the call holds the stager, before the exchange.
        :raises: as :meth:`replicate`.
        """
        with self._thread_lock:
            self._check_usable()
            if started is not None:
                started()
            while self._retired:  # replicas replaced by earlier calls
                unlink_if_present(self._retired.pop(0))
            self._phase = ReplicationPhase.STAGED
            begun = time.perf_counter()
            deadline = time.monotonic() + self.timeout
            mine = encoded.relabel(owner_rank=self.rank, holder_rank=self.send_to)
            del encoded
            path = self._replica_path(step)
            try:
                self._exchange_blocking(mine, path, deadline)
                del mine
                link = blocking.BlockingLink(
                    self.process_group, deadline, send_to=self.recv_from, recv_from=self.send_to
                )
                self._live = link
                try:
                    blocking.exchange_ack(link, True)
                except PeerReportedError:
                    self._phase = ReplicationPhase.ACKNOWLEDGED
                    raise
                self._phase = ReplicationPhase.ACKNOWLEDGED
            except BaseException as exc:
                if self._phase.failure_breaks_group and self._broken is None:
                    self._broken = _describe(exc)
                raise
            finally:
                self._live = None
        log.debug("replicated step %d (worker thread) in %.3fs", step, time.perf_counter() - begun)

    def _exchange_blocking(self, mine: Encoded, path: Path, deadline: float) -> None:
        sink = BlockingSink(path, self.recv_from, self._headers.parse, self._body_buffer)
        link = blocking.BlockingLink(
            self.process_group,
            deadline,
            send_to=self.send_to,
            recv_from=self.recv_from,
            on_posted=self._posted,
        )
        self._live = link
        try:
            blocking.exchange(
                link,
                _transport.Payload(mine.prefix, mine.segments, mine.body_nbytes),
                chunk_bytes=self.chunk_bytes,
                max_body_bytes=self.max_replica_bytes,
                allocate=sink.allocate,
                on_prefix=sink.on_prefix,
                on_chunk=sink.on_chunk,
            )
            self._phase = ReplicationPhase.EXCHANGED
            sink.finish()
            if sink.retired is not None:
                self._retired.append(sink.retired)
            if self.keep is not None:
                self._retired += self._beyond_keep()
        except Exception as exc:
            if self._phase is ReplicationPhase.EXCHANGED:
                self._refuse_blocking(exc, deadline)
            raise
        finally:
            sink.close()

    def _refuse_blocking(self, exc: Exception, deadline: float) -> None:
        """Tell the peer its replica is not kept (blocking); the caller raises."""
        link = blocking.BlockingLink(
            self.process_group, deadline, send_to=self.recv_from, recv_from=self.send_to
        )
        self._live = link
        try:
            blocking.exchange_ack(link, False, f"rank {self.rank} could not keep it: {exc}")
        except PeerReportedError:
            self._phase = ReplicationPhase.ACKNOWLEDGED  # the peer failed too, and said so
        except TransportError as ack_failure:
            self._broken = _describe(ack_failure)
        else:
            self._phase = ReplicationPhase.ACKNOWLEDGED

    def _body_buffer(self, nbytes: int) -> torch.Tensor:
        """The buffer the worker-thread path receives into, kept from call to call."""
        if self._thread_body is None or self._thread_body.numel() < nbytes:
            self._thread_body = None
            self._thread_body = torch.empty(nbytes, dtype=torch.uint8)
        return self._thread_body

    def interrupt(self) -> None:
        """Break the worker-thread call in flight, if any (blocking, ~1 ms): its waits, and
        the peers', fail at once.  For a save abandoned mid-exchange."""
        link = self._live
        if link is not None:
            link.interrupt()

    def inbox_stats(self) -> PoolStats:
        """Memory of the pool that receives the peer's replicas (reused across steps)."""
        return self._inbox.stats()

    @property
    def phase(self) -> ReplicationPhase:
        """How far the latest exchange got (:attr:`ReplicationPhase.ACKNOWLEDGED` before the first)."""
        return self._phase

    @property
    def broken(self) -> bool:
        """Whether an exchange failed mid-protocol and broke the process group."""
        return self._broken is not None

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError("replicate() called on a closed ReplicationStager")
        if self._broken is not None:
            raise TransportError(
                "an earlier exchange failed and broke the process group; destroy it, create a new "
                f"one and a new ReplicationStager (earlier failure: {self._broken})"
            )

    async def _replicate(
        self,
        staged: Any,
        step: int,
        checkpoint_id: str | None,
        stage_stats: StageStats | None,
        shared: Encoded | None = None,
    ) -> ReplicationResult:
        await self._start()
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            self._check_usable()
            self._phase = ReplicationPhase.STAGED
            started = time.perf_counter()
            deadline = started + self.timeout
            ckpt = checkpoint_id if checkpoint_id is not None else f"step{step}-{uuid.uuid4().hex[:12]}"
            with one_error():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._delete_retired)  # (done already when replicate() staged)
                    encoded = await self._encode(staged, step, ckpt, shared, stage_stats)
                    del shared
            encoded_at = time.perf_counter()
            path = self._replica_path(step)
            try:
                received, header, persist_started, acked = await self._exchange_and_keep(
                    encoded, path, deadline
                )
                await self._ack(True, "", deadline)
            except BaseException as exc:
                if self._phase.failure_breaks_group and self._broken is None:
                    self._broken = _describe(exc)
                raise
            done = time.perf_counter()
        stats = ReplicationStats(
            stage=stage_stats,
            encode_seconds=encoded_at - started,
            exchange=received.stats,
            persist_seconds=acked - persist_started,
            ack_seconds=done - acked,
            seconds=done - started,
        )
        log.debug(
            "replicated step %d: sent %d bytes to rank %d, holding rank %d's %d bytes at %s in %.3fs",
            step,
            stats.bytes_sent,
            self.send_to,
            self.recv_from,
            stats.bytes_received,
            path,
            stats.seconds,
        )
        return received_result(staged, path, header, self.send_to, self.recv_from, stats, received.body)

    async def _encode(
        self, staged: Any, step: int, ckpt: str, shared: Encoded | None, stats: StageStats | None
    ) -> Encoded:
        """This rank's replica: ``shared``'s body and checksums with a new prefix, or encoded
        anew, with the layout kept from an earlier call of the same structure if it matches
        (:mod:`astage._format.layouts`; a copy the stager refilled is only walked)."""
        make: Callable[[], Encoded]
        if shared is not None:
            make = functools.partial(shared.relabel, owner_rank=self.rank, holder_rank=self.send_to)
        else:
            layout = await self._lay_out(staged, step, ckpt, stats)
            make = dataclasses.replace(layout, holder_rank=self.send_to).encode
        # Boxed: the worker thread must not keep the replica, which views the staged
        # buffers, once this resumes (see astage._util.threads).
        return await run_sync(make)

    async def _lay_out(self, staged: Any, step: int, ckpt: str, stats: StageStats | None) -> FileLayout:
        # Only astage's stager checks a copy whole at its release (see astage._format.layouts).
        trusted = stats is not None and stats.refilled and isinstance(self.stager, DefaultStager)
        refilled = stats.copy if stats is not None and trusted else None
        layout = await self._layouts.lay_out(staged, step=step, checkpoint_id=ckpt, refilled=refilled)
        copy = stats.copy if stats is not None else None
        return await self._layouts.finish(staged, layout, copy=copy)

    async def _exchange_and_keep(
        self, encoded: Encoded, path: Path, deadline: float
    ) -> tuple[_transport.Received, FileHeader, float, float]:
        """Exchange replicas with the peers and make the received one durable at ``path``.

        :returns: what was received, its header, and when persisting began and ended.
        A local failure after the exchange is told to the peer before it is raised.
        """
        sink = StreamingSink(path, self.recv_from, self._inbox, headers=self._headers)
        try:
            received = await self._wire(
                _transport.Payload(encoded.prefix, encoded.segments, encoded.body_nbytes),
                sink,
                send_to=self.send_to,
                recv_from=self.recv_from,
                deadline=deadline,
            )
            assert received is not None
            self._phase = ReplicationPhase.EXCHANGED
            persist_started = time.perf_counter()
            header = await sink.finish()
            if sink.retired is not None:
                self._retired.append(sink.retired)
            if self.keep is not None:
                self._retired += await blocking_io(self._beyond_keep)
        except Exception as exc:
            if self._phase is ReplicationPhase.EXCHANGED:
                await self._refuse(exc, deadline)
            raise
        finally:
            await sink.aclose()
        return received, header, persist_started, time.perf_counter()

    async def _refuse(self, exc: Exception, deadline: float) -> None:
        """Tell the peer its replica is not kept (the group is in step); the caller raises."""
        try:
            await self._ack(False, f"rank {self.rank} could not keep it: {exc}", deadline)
        except PeerReportedError:
            pass  # the peer failed too, and said so: acknowledged both ways
        except TransportError as ack_failure:
            # The peer was not told, and the transport broke the group doing so.
            self._broken = _describe(ack_failure)

    @contextlib.asynccontextmanager
    async def collective(
        self, *, agreed: tuple[type[BaseException], ...] = ()
    ) -> AsyncIterator[GroupSession]:
        """This stager's group for one of astage's own collective operations (a collective
        restore), not for users: started, usable, and held alone for the block.

        An exception out of the block breaks the group (peers may be mid-protocol), unless
        it is one of ``agreed``: outcomes every rank decided alike after a complete round.
        """
        self._check_usable()
        await self._start()
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            self._check_usable()
            try:
                yield GroupSession(self, self._inbox, self._wire)
            except agreed:
                raise
            except BaseException as exc:
                if self._broken is None:
                    self._broken = _describe(exc)
                raise

    async def _wire(
        self,
        payload: _transport.Payload | None,
        sink: StreamingSink | None,
        *,
        send_to: int | None,
        recv_from: int | None,
        deadline: float,
        track_phase: bool = True,
    ) -> _transport.Received | None:
        """Send ``payload`` to ``send_to`` and/or receive into ``sink`` from ``recv_from``.

        The one path to the wire for replicating, recovering and restoring: one transport
        call with this stager's group, caps and chunk size, within ``deadline``
        (``time.perf_counter``).  With ``track_phase``, an exchange marks the phase *posted*
        as it first touches the group.
        """
        timeout = time_left(deadline)
        if recv_from is None:
            assert payload is not None
            assert send_to is not None
            await _transport.send(
                self.process_group, payload, to=send_to, timeout=timeout, chunk_bytes=self.chunk_bytes
            )
            return None
        hooks: dict[str, Any] = {"max_body_bytes": self.max_replica_bytes}
        if sink is not None:
            hooks |= {"allocate": sink.allocate, "on_prefix": sink.on_prefix, "on_chunk": sink.on_chunk}
        if payload is None:
            return await _transport.recv(self.process_group, from_=recv_from, timeout=timeout, **hooks)
        assert send_to is not None
        return await _transport.exchange(
            self.process_group,
            payload,
            send_to=send_to,
            recv_from=recv_from,
            timeout=timeout,
            chunk_bytes=self.chunk_bytes,
            on_posted=self._posted if track_phase else None,
            **hooks,
        )

    async def recover(self) -> Any | None:
        """Get this rank's own state back from the peer that holds its replica.

        Collective: every rank of the group calls it at the same time (a restarted rank
        and its healthy peers alike).  Each rank sends the replica it holds back to its
        owner and receives its own from its holder.

        :returns: this rank's last replicated state_dict (CPU), or ``None`` when the holder
            has no valid replica of it.
        :raises IntegrityError: the replica received is corrupt or not this rank's.
        :raises PeerTimeoutError: the exchange did not finish within ``timeout``.
        :raises TransportError: a peer failed.
        """
        self._check_usable()
        await self._start()
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            steps = await blocking_io(self.held_replicas)
            held = steps[max(steps)] if steps else self.storage_dir / "none"
            found = await blocking_io(read_replica_file, held)
            prefix, segments, nbytes = (
                (found[0], ((0, found[1]),), found[1].numel()) if found else (b"", (), 0)
            )
            self._phase = ReplicationPhase.STAGED
            try:
                received = await self._wire(
                    _transport.Payload(prefix, segments, nbytes),
                    None,
                    send_to=self.recv_from,
                    recv_from=self.send_to,
                    deadline=time.perf_counter() + self.timeout,
                )
            except BaseException as exc:
                if self._phase.failure_breaks_group:
                    self._broken = _describe(exc)
                raise
            # Recovery has no acknowledgement: the exchange completing ends the protocol.
            self._phase = ReplicationPhase.ACKNOWLEDGED
        assert received is not None
        if not received.prefix:
            return None
        header = parse_prefix(received.prefix)
        if header.owner_rank != self.rank:
            raise IntegrityError(
                f"rank {self.send_to} sent back rank {header.owner_rank}'s replica, not ours"
            )
        return await anyio.to_thread.run_sync(decode, header, received.body)

    def held_replicas(self) -> dict[int, Path]:
        """The replica files this rank holds of its owner's state, by step (blocking).

        Only names are read (the step of the single file kept without ``keep`` comes from its
        header); a file may still turn out corrupt when read.
        """
        return held_replica_paths(self.storage_dir, owner_rank=self.recv_from, holder_rank=self.rank)

    def _beyond_keep(self) -> list[Path]:
        # The holder keeps the ``keep`` highest steps it received.  An owner commits a step
        # only once its holder acknowledged that step's replica, so the owner's newest
        # committed step is among them (unless ``keep`` saves in a row failed locally on the
        # owner after replicating).
        assert self.keep is not None
        held = self.held_replicas()
        return [held[step] for step in sorted(held, reverse=True)[self.keep :]]

    def _replica_path(self, step: int) -> Path:
        """Where this rank keeps the replica of ``step`` it holds for its peer (one file
        for every step when ``keep`` is ``None``)."""
        return replica_path(
            self.storage_dir,
            owner_rank=self.recv_from,
            holder_rank=self.rank,
            step=None if self.keep is None else step,
        )

    async def _delete_retired(self) -> None:
        # One at a time, so that a cancellation leaves the rest listed (the sweep at the
        # next start-up removes whatever a crash leaves: they carry temp-file names).
        while self._retired:
            await blocking_io(unlink_if_present, self._retired[0])
            self._retired.pop(0)

    def _posted(self) -> None:
        self._phase = ReplicationPhase.POSTED

    async def _ack(self, ok: bool, message: str, deadline: float) -> None:
        """Exchange acknowledgements; both sides agreed once it returns or the peer reports."""
        try:
            await _transport.exchange_ack(
                self.process_group,
                ok,
                send_to=self.send_to,
                recv_from=self.recv_from,
                timeout=time_left(deadline),
                message=message,
            )
        except PeerReportedError:
            self._phase = ReplicationPhase.ACKNOWLEDGED
            raise
        self._phase = ReplicationPhase.ACKNOWLEDGED
