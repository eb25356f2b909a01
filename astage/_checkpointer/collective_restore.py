"""Collective restore: every rank of a replication group gets back the same step, without a
shared file system.

``Checkpointer.restore()`` comes here when its replication object is a
:class:`~astage.ReplicationStager` (see its docstring for when).  Every rank of the
replication group calls it at the same time.  Rounds, all over the replication group:

1. **Inventory.**  Each rank lists the steps it can restore from its own files (committed,
   header and commit marker checked) and the steps of its ring *owner* (``recv_from``) whose
   replica it holds (header checked).  The ranks exchange these lists: W - 1 small
   transport exchanges, rank ``r`` sending to ``r + i`` and receiving from ``r - i`` in
   round ``i``, so every rank ends with every list (and the deadline and group-breaking
   rules of :mod:`astage._transport`).
2. **Decision** (:func:`plan_restore`, pure): the newest step that every rank can restore,
   from its own files or from the replica its holder keeps (or the step asked for).  Every
   rank computes it from the same lists, so every rank reaches the same step, or raises the
   same error naming the unrecoverable ranks and the steps considered.
3. **Recovery.**  A rank that has the step loads it (checksums verified).  A holder whose
   owner lacks it sends the replica file as it is; the owner writes it as its own
   checkpoint file of that step while it lands, verifying each storage's checksum, commits
   it with a commit marker (healing) and rebuilds the state from the verified bytes.
4. **Outcome.**  The ranks exchange how that went.  If every rank has its state, all
   return.  Otherwise the copies that failed (a corrupt local file, a corrupt or unreadable
   replica) are excluded on every rank alike and the protocol starts again at 1, so a
   corrupt copy is never restored and every rank still lands on one step.

Invariants: all ranks make the same sequence of calls on the group (the decision and the
outcome are functions of the exchanged lists only); the whole restore honours the stager's
``timeout`` (a dead or frozen peer is a :class:`TransportError` or
:class:`PeerTimeoutError`); a failure mid-protocol breaks the group, as a failed
``replicate`` does, and the stager then refuses further exchanges.  Nothing unverified is
ever committed: the received file is renamed into place only once every byte checked.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import torch

from .. import _transport
from .._files.directory import open_step_dir
from .._files.durable import DirOpener, blocking_io
from .._files.markers import FileEntry, Marker, header_check, storages_crc32c
from .._files.reading import CheckpointFile, inspect_checkpoint_file, load_checkpoint_file
from .._files.steps import StepStore
from .._format.codec import BodyVerifier, FileHeader, parse_prefix
from .._replication.records import GroupSession, time_left
from .._replication.sink import StreamingSink
from .._replication.stager import ReplicationStager
from .._staging.pool import BufferPool
from .._staging.rebuild import rebuild
from .._util.errors import (
    ConfigurationError,
    IntegrityError,
    PersistError,
    ResourceError,
    TransportError,
    UnsupportedInputError,
    one_error,
)
from .local_restore import ReadProgress
from .restore_into import RestoreLoads

log = logging.getLogger("astage.restore")

_MAGIC: Final = 0x4153_5452_5354_5231
"""First word of every record: ``b"ASTRSTR1"`` as a big-endian int64."""
_INVENTORY: Final = 1
_OUTCOME: Final = 2
_RECORD_CAP: Final = 8 << 20
"""Largest record accepted from a peer (a million steps)."""

# Outcome codes, per rank: how its own copy and its fetch from the holder went.
NOT_NEEDED: Final = 0
OK: Final = 1
CORRUPT: Final = 2
"""The copy failed its checksums or its header check: it is never restored."""
UNREADABLE: Final = 3
"""The holder could not read its replica (gone, or an I/O error) and sent nothing."""
UNWRITABLE: Final = 4
"""The owner could not write the received copy to its disk: fatal for the restore."""


@dataclasses.dataclass(frozen=True)
class Inventory:
    """What one rank can offer.

    :ivar own: steps it can restore from its own files.
    :ivar held: steps of its owner's (``recv_from``'s) state whose replica it holds.
    :ivar send_to: the rank that holds its replica.
    :ivar recv_from: the rank whose replica it holds.
    """

    own: frozenset[int]
    held: frozenset[int]
    send_to: int
    recv_from: int

    def record(self) -> list[int]:
        return [
            self.send_to,
            self.recv_from,
            len(self.own),
            *sorted(self.own),
            len(self.held),
            *sorted(self.held),
        ]

    @classmethod
    def from_record(cls, values: Sequence[int], source: int, world: int) -> Inventory:
        try:
            send_to, recv_from, n_own = values[0], values[1], values[2]
            own = values[3 : 3 + n_own]
            n_held = values[3 + n_own]
            held = values[4 + n_own : 4 + n_own + n_held]
            ok = len(own) == n_own and len(held) == n_held and len(values) == 4 + n_own + n_held
        except IndexError:
            ok = False
        if not ok or not (0 <= send_to < world and 0 <= recv_from < world):
            raise TransportError(f"rank {source} sent a malformed restore inventory")
        if any(s < 0 for s in (*own, *held)):
            raise TransportError(f"rank {source} sent a negative step in its restore inventory")
        return cls(frozenset(own), frozenset(held), send_to, recv_from)


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """The agreed step, and which ranks get it from their holder (the rest load their own)."""

    step: int
    fetch: frozenset[int]
    holders: tuple[int, ...]


def plan_restore(
    inventories: Sequence[Inventory], requested: int | None, refused: Sequence[str] = ()
) -> RestorePlan:
    """The newest step every rank can restore (or ``requested``), and where each gets it.

    Pure: every rank calls it with the same arguments and gets the same answer.

    :param refused: copies already refused (corrupt or unreadable), for the error message.
    :raises ConfigurationError: the ranks disagree on the ring.
    :raises IntegrityError: no such step, and a copy was refused as corrupt on the way.
    :raises ResourceError: no such step; names the unrecoverable ranks and the steps considered.
    """
    world = len(inventories)
    holders = tuple(inv.send_to for inv in inventories)
    for rank, inv in enumerate(inventories):
        if inv.send_to == rank or inventories[inv.send_to].recv_from != rank:
            raise ConfigurationError(
                f"the ranks disagree on the replication ring: rank {rank} sends to rank {inv.send_to}, "
                f"which receives from rank {inventories[inv.send_to].recv_from} "
                "(the same peer_offset everywhere?)"
            )

    def restorable(rank: int) -> frozenset[int]:
        return inventories[rank].own | inventories[holders[rank]].held

    considered = sorted(set().union(*(inv.own | inv.held for inv in inventories)), reverse=True)
    candidates = [requested] if requested is not None else considered
    for step in candidates:
        if all(step in restorable(rank) for rank in range(world)):
            fetch = frozenset(rank for rank in range(world) if step not in inventories[rank].own)
            return RestorePlan(step, fetch, holders)
    lost = [rank for rank in range(world) if not restorable(rank) & set(candidates)]
    if lost:
        why = "; ".join(
            f"rank {rank} (no valid checkpoint of its own, and its holder rank {holders[rank]} "
            "no valid replica of it)"
            for rank in lost
        )
        what = f"cannot restore {'step ' + str(requested) if requested is not None else 'any step'}: {why}"
    else:
        per_rank = ", ".join(f"rank {rank}: {sorted(restorable(rank))}" for rank in range(world))
        what = f"no step can be restored by every rank (restorable steps per rank: {per_rank})"
    message = f"{what}; steps considered: {sorted(considered)}"
    if refused:
        message += "; refused as corrupt or unreadable: " + "; ".join(refused)
        raise IntegrityError(message)
    raise ResourceError(message)


# -- the exchanges ----------------------------------------------------------------------------


def _pack(kind: int, round_: int, values: Sequence[int]) -> bytes:
    return struct.pack(f"<4q{len(values)}q", _MAGIC, kind, round_, len(values), *values)


def _unpack(data: bytes, kind: int, round_: int, source: int) -> list[int]:
    if len(data) < 32 or len(data) % 8:
        raise TransportError(f"rank {source} sent a malformed restore record ({len(data)} bytes)")
    magic, got_kind, got_round, n = struct.unpack_from("<4q", data)
    if magic != _MAGIC or n != len(data) // 8 - 4:
        raise TransportError(f"rank {source} sent a malformed restore record")
    if (got_kind, got_round) != (kind, round_):
        raise TransportError(
            f"rank {source} is at another point of the restore protocol (record {got_kind} of "
            f"round {got_round}, expected {kind} of round {round_}): did every rank call restore()?"
        )
    return list(struct.unpack_from(f"<{n}q", data, 32))


async def all_gather(
    rs: GroupSession, values: Sequence[int], *, kind: int, round_: int, deadline: float
) -> list[list[int]]:
    """Every rank's ``values``, in rank order, over ``rs``'s group (W - 1 exchanges)."""
    world, rank = rs.world_size, rs.rank
    gathered: list[list[int]] = [[] for _ in range(world)]
    gathered[rank] = list(values)
    blob = _pack(kind, round_, values)
    for i in range(1, world):
        source = (rank - i) % world
        received = await _transport.exchange(
            rs.process_group,
            _transport.Payload(blob, (), 0),
            send_to=(rank + i) % world,
            recv_from=source,
            timeout=time_left(deadline),
            max_body_bytes=0,
            max_prefix_bytes=_RECORD_CAP,
        )
        gathered[source] = _unpack(received.prefix, kind, round_, source)
    return gathered


# -- what this rank has -------------------------------------------------------------------------


def _own_steps(store: StepStore) -> set[int]:
    """Committed steps whose local file's header matches its commit marker (blocking)."""
    found = set()
    for step, marker in store.committed():
        entry = marker.files[0]
        path = store.step_dir(step) / entry.name
        check = header_check(
            path, step=step, rank=store.rank, checkpoint_id=marker.checkpoint_id, entry=entry
        )
        try:
            # Opened from the step directory, itself opened without following a link.
            step_fd = open_step_dir(store.dir_fd, path.parent.name, create=False)
            try:
                f = CheckpointFile(path, step_fd)
            finally:
                os.close(step_fd)
            try:
                header, _ = f.header()
            finally:
                f.close()
            check(header)
        except (OSError, IntegrityError) as exc:
            log.warning("rank %d: the local checkpoint of step %d is unusable: %s", store.rank, step, exc)
            continue
        found.add(step)
    return found


def _held_steps(rs: GroupSession) -> dict[int, Path]:
    """Replicas of the owner's state this rank holds whose header checks out (blocking)."""
    found = {}
    for step, path in rs.held_replicas().items():
        try:
            info = inspect_checkpoint_file(path)
            if info.owner_rank != rs.recv_from or info.step != step:
                raise IntegrityError(f"it holds step {info.step} of rank {info.owner_rank}")
        except (OSError, IntegrityError) as exc:
            log.warning("rank %d: ignoring the held replica %s: %s", rs.rank, path, exc)
            continue
        found[step] = path
    return found


def _map_replica(path: Path, owner: int, step: int) -> tuple[bytes, torch.Tensor]:
    """A held replica's prefix, header checked, and its body mapped (the receiver checks it).

    The body is a private, read-only-in-practice mapping of the file: its pages are read as
    the transport sends them, so reading the disk overlaps the transfer.
    """
    f = CheckpointFile(path)
    try:
        header, st = f.header()
        if header.owner_rank != owner or header.step != step:
            raise IntegrityError(f"{path} holds step {header.step} of rank {header.owner_rank}")
        prefix = f.pread(header.prefix_nbytes, 0)
    finally:
        f.close()
    data = torch.from_file(str(path), shared=False, size=st.st_size, dtype=torch.uint8)
    return prefix, data[header.prefix_nbytes :]


def _decode_verified(header: FileHeader, body: torch.Tensor) -> Any:
    """Rebuild the state over a body every byte of which was verified as it landed."""
    array = body.numpy()
    storages = [
        torch.from_numpy(array[seg.offset : seg.offset + seg.nbytes]).untyped_storage()
        for seg in header.segments
    ]
    return rebuild(header.plan, storages)


class _HolderHadNone(Exception):
    """The holder sent an empty payload: it could not read its replica."""


class _HealingSink(StreamingSink):
    """Receives this rank's own state from its holder into its checkpoint file of ``step``.

    Unlike a replica exchange, nothing that comes in aborts the transfer (so the group stays
    usable and every rank reaches the outcome round): a wrong header or a bad checksum is
    drained and reported by :meth:`finish`.
    """

    def __init__(
        self,
        path: Path,
        owner_rank: int,
        step: int,
        inbox: BufferPool,
        progress: ReadProgress,
        *,
        open_dir: DirOpener | None = None,
    ) -> None:
        # The inbox is not used: the body becomes the restored state, and a fresh buffer is
        # faulted in by the receiving threads as it lands instead of being pre-faulted first.
        super().__init__(path, owner_rank, inbox, open_dir=open_dir)
        self.step = step
        self.progress = progress
        self.empty = False
        self.body: torch.Tensor | None = None

    async def on_prefix(self, prefix: bytes) -> None:
        if not prefix:
            self.empty = True
            return
        try:
            header = await anyio.to_thread.run_sync(parse_prefix, prefix)
            if header.owner_rank != self.owner_rank or header.step != self.step:
                raise IntegrityError(
                    f"expected step {self.step} of rank {self.owner_rank}, the holder sent step "
                    f"{header.step} of rank {header.owner_rank}"
                )
        except IntegrityError as exc:
            self.error = exc
            return
        self.verifier = BodyVerifier(header)
        await self._write(memoryview(prefix), open_first=True)

    def allocate(self, nbytes: int) -> torch.Tensor:
        if self.verifier is not None and nbytes != self.verifier.header.body_nbytes:
            self.error = self.error or IntegrityError(
                f"the holder announces a {nbytes}-byte body, "
                f"its header says {self.verifier.header.body_nbytes}"
            )
        self.body = torch.empty(nbytes, dtype=torch.uint8)  # (drained and dropped unless valid)
        self.progress.begin(self.step, nbytes)
        return self.body

    async def on_chunk(self, offset: int, chunk: torch.Tensor) -> None:
        if self.verifier is not None and self.error is None:
            await super().on_chunk(offset, chunk)
        # Received, and written and verified (or drained once refused).
        self.progress.advance(chunk.numel() * chunk.element_size())

    async def finish(self) -> FileHeader:
        self.exchanged = True
        if self.empty:
            raise _HolderHadNone()
        if self.error is not None:
            raise self.error
        assert self.verifier is not None
        self.verifier.finish()
        await self.writer.commit()
        return self.verifier.header


# -- the protocol -------------------------------------------------------------------------------


@dataclasses.dataclass
class _Attempt:
    """One round's outcome on this rank."""

    local: int = NOT_NEEDED
    fetched: int = NOT_NEEDED
    state: Any = None
    error: Exception | None = None  # a transport failure: re-raised
    unwritable: PersistError | None = None
    loads: RestoreLoads | None = None  # into the caller's tensors; None: into new ones
    refused: UnsupportedInputError | None = None  # the copy does not fit the destination


async def collective_restore(
    store: StepStore,
    rs: ReplicationStager,
    step: int | None,
    progress: ReadProgress,
    drain: Callable[[], Awaitable[None]],
    loads: RestoreLoads | None = None,
) -> Any:
    """Restore ``step`` (default: the newest every rank can) on every rank of ``rs``'s group.

    ``progress`` sees the bytes of this rank's own file read, or of its copy received.
    ``loads`` reads the own file and turns a received copy into the result (into the
    caller's tensors, for ``restore(into=...)``); a copy that does not fit them is refused
    once the ranks have agreed, so the group stays in step.

    :raises ConfigurationError: the Checkpointer's rank is not the rank in the group.
    :raises ResourceError: no step every rank can restore (names the ranks and steps).
    :raises IntegrityError: the same, when copies were refused as corrupt on the way.
    :raises PeerTimeoutError: a peer did not take part within the stager's timeout.
    :raises TransportError: a peer failed; the group is then broken.
    :raises PersistError: this rank could not write the copy it received.
    """
    if store.rank != rs.rank:
        raise ConfigurationError(
            f"a collective restore needs Checkpointer(rank=...) to be the rank in the replication "
            f"group: it is {store.rank}, the group says {rs.rank}"
        )
    await drain()  # in-flight saves replicate: let them finish in their order first
    # Decided alike on every rank after a complete round (or this rank's own disk failed
    # after one): the group is in step and stays usable.  Anything else breaks it.
    agreed = (ConfigurationError, ResourceError, IntegrityError, PersistError, UnsupportedInputError)
    async with rs.collective(agreed=agreed) as session:
        return await _restore(store, session, step, progress, loads)


async def _restore(
    store: StepStore,
    rs: GroupSession,
    requested: int | None,
    progress: ReadProgress,
    loads: RestoreLoads | None,
) -> Any:
    started = time.perf_counter()
    deadline = started + rs.timeout
    own_bad: set[int] = set()
    held_bad: set[int] = set()
    refused: list[str] = []
    round_ = 0
    while True:
        own = await blocking_io(_own_steps, store) - own_bad
        held = {s: p for s, p in (await blocking_io(_held_steps, rs)).items() if s not in held_bad}
        mine = Inventory(frozenset(own), frozenset(held), rs.send_to, rs.recv_from)
        records = await all_gather(rs, mine.record(), kind=_INVENTORY, round_=round_, deadline=deadline)
        inventories = [Inventory.from_record(r, source, rs.world_size) for source, r in enumerate(records)]
        plan = plan_restore(inventories, requested, refused)
        attempt = await _attempt(store, rs, plan, held, deadline, progress, loads)
        if attempt.error is not None:
            raise attempt.error
        outcomes = await all_gather(
            rs, [attempt.local, attempt.fetched], kind=_OUTCOME, round_=round_, deadline=deadline
        )
        s = plan.step
        if not _judge(rs, plan, attempt, outcomes, refused, own_bad, held_bad):
            how = "from its holder" if rs.rank in plan.fetch else "from its own files"
            log.info(
                "rank %d restored step %d %s (ranks %s from their holders) in %.3f s",
                rs.rank,
                s,
                how,
                sorted(plan.fetch),
                time.perf_counter() - started,
            )
            if requested is None:
                await _drop_newer(store, rs, s)
            if attempt.refused is not None:
                raise attempt.refused
            return attempt.state
        log.warning("rank %d: restoring step %d failed somewhere (%s); trying again", rs.rank, s, refused[-1])
        round_ += 1


def _judge(
    rs: GroupSession,
    plan: RestorePlan,
    attempt: _Attempt,
    outcomes: list[list[int]],
    refused: list[str],
    own_bad: set[int],
    held_bad: set[int],
) -> bool:
    """Whether the round failed somewhere; notes the copies to exclude from the next round.

    :raises TransportError: a rank sent a malformed outcome.
    :raises ResourceError: a rank could not write the copy it received (no retry helps).
    """
    for source, outcome in enumerate(outcomes):
        if len(outcome) != 2 or not all(NOT_NEEDED <= code <= UNWRITABLE for code in outcome):
            raise TransportError(f"rank {source} sent a malformed restore outcome")
    s = plan.step
    unwritable = [rank for rank, (_, fetched) in enumerate(outcomes) if fetched == UNWRITABLE]
    if unwritable:
        if attempt.unwritable is not None:
            raise attempt.unwritable
        raise ResourceError(
            f"cannot restore step {s}: rank(s) {unwritable} could not write the copy they "
            "received from their holder (see their logs)"
        )
    failed = False
    for rank, (local, fetched) in enumerate(outcomes):
        holder = plan.holders[rank]
        if local == CORRUPT:
            failed = True
            refused.append(f"the local checkpoint of step {s} of rank {rank}")
            if rank == rs.rank:
                own_bad.add(s)
        if fetched in (CORRUPT, UNREADABLE):
            failed = True
            what = "corrupt" if fetched == CORRUPT else "unreadable"
            refused.append(f"the replica of step {s} of rank {rank} held by rank {holder} ({what})")
            if holder == rs.rank:
                held_bad.add(s)
    return failed


async def _attempt(
    store: StepStore,
    rs: GroupSession,
    plan: RestorePlan,
    held: dict[int, Path],
    deadline: float,
    progress: ReadProgress,
    loads: RestoreLoads | None,
) -> _Attempt:
    """Load this rank's copy of the agreed step, and carry out the transfers it takes part in."""
    attempt = _Attempt(loads=loads)
    s = plan.step
    send = rs.recv_from in plan.fetch  # our owner needs its replica from us
    receive = rs.rank in plan.fetch

    async def load_local() -> None:
        marker = store.marker(s)
        assert marker is not None  # an own step: committed
        entry = marker.files[0]
        path = store.step_dir(s) / entry.name
        check = header_check(path, step=s, rank=store.rank, checkpoint_id=marker.checkpoint_id, entry=entry)
        try:
            load = load_checkpoint_file if loads is None else loads.file
            attempt.state = await store.load(
                s, path, progress.checking(s, check), progress.advance, load=load
            )
            attempt.local = OK
        except UnsupportedInputError as exc:  # the file is sound; it does not fit the destination
            attempt.refused, attempt.local = exc, OK
        except (OSError, IntegrityError) as exc:
            log.warning("rank %d: the local checkpoint of step %d is unusable: %s", rs.rank, s, exc)
            attempt.local = CORRUPT

    async def transfer() -> None:
        try:
            source = held.get(s) if send else None
            await _transfer(store, rs, plan, source, send, receive, attempt, deadline, progress)
        except Exception as exc:
            attempt.error = exc
            raise

    try:
        with one_error():
            async with anyio.create_task_group() as tg:
                if not receive:
                    tg.start_soon(load_local)
                if send or receive:
                    tg.start_soon(transfer)
    except BaseException:
        if attempt.error is None:
            raise
    return attempt


async def _transfer(
    store: StepStore,
    rs: GroupSession,
    plan: RestorePlan,
    source: Path | None,
    send: bool,
    receive: bool,
    attempt: _Attempt,
    deadline: float,
    progress: ReadProgress,
) -> None:
    payload = await _outgoing(rs, plan.step, source) if send else None
    sink = await _incoming(store, rs, plan.step, attempt, progress) if receive else None
    try:
        await rs.transfer(
            payload,
            sink,
            send_to=rs.recv_from if send else None,
            recv_from=rs.send_to if receive else None,
            deadline=deadline,
            track_phase=False,
        )
        del payload
        if sink is not None:
            await _heal(store, rs, sink, attempt)
    finally:
        if sink is not None:
            await sink.aclose()


async def _outgoing(rs: GroupSession, step: int, source: Path | None) -> _transport.Payload:
    """The replica of ``step`` this rank holds for its owner, or nothing if it cannot be read."""
    try:
        if source is None:
            raise FileNotFoundError(f"no replica of step {step} of rank {rs.recv_from}")
        prefix, body = await anyio.to_thread.run_sync(_map_replica, source, rs.recv_from, step)
        return _transport.Payload(prefix, ((0, body),), body.numel())
    except (OSError, IntegrityError) as exc:
        # Take part all the same, with nothing: the owner reports it and the ranks agree.
        log.warning("rank %d: cannot send rank %d its step %d: %s", rs.rank, rs.recv_from, step, exc)
        return _transport.Payload(b"", (), 0)


async def _incoming(
    store: StepStore, rs: GroupSession, step: int, attempt: _Attempt, progress: ReadProgress
) -> _HealingSink:
    """The sink that writes the copy of ``step`` received from the holder as this rank's own."""
    try:
        await store.forget(step)
    except OSError as exc:  # take part all the same: the outcome round reports it
        attempt.unwritable = PersistError(
            f"cannot uncommit the unusable step {step} of rank {rs.rank}: {exc}"
        )
    # The step directory is opened without following a link, like the Checkpointer's own.
    opener = store.step_dir_opener(step)
    path = store.data_path(step)
    return _HealingSink(path, rs.rank, step, rs.inbox, progress, open_dir=opener)


async def _heal(store: StepStore, rs: GroupSession, sink: _HealingSink, attempt: _Attempt) -> None:
    """Commit the received copy as this rank's checkpoint of the step; rebuild the state."""
    if attempt.unwritable is not None:
        attempt.fetched = UNWRITABLE
        return
    try:
        header = await sink.finish()
    except _HolderHadNone:
        attempt.fetched = UNREADABLE
        return
    except IntegrityError as exc:
        log.error(
            "rank %d: refused the copy of step %d from rank %d: %s", rs.rank, sink.step, rs.send_to, exc
        )
        attempt.fetched = CORRUPT
        return
    except PersistError as exc:
        log.error("rank %d: cannot write the copy of step %d it received: %s", rs.rank, sink.step, exc)
        attempt.fetched = UNWRITABLE
        attempt.unwritable = exc
        return
    entry = FileEntry(store.data_name, header.total_nbytes, storages_crc32c(header))
    marker = Marker(header.step, store.rank, header.checkpoint_id, time.time(), (entry,))
    try:
        with anyio.CancelScope(shield=True):
            await store.commit(marker)
    except PersistError as exc:
        log.error("rank %d: cannot commit the step %d it received: %s", rs.rank, header.step, exc)
        attempt.fetched = UNWRITABLE
        attempt.unwritable = exc
        return
    body = sink.body if sink.body is not None else torch.empty(0, dtype=torch.uint8)
    sink.body = None
    attempt.fetched = OK
    if attempt.loads is None or attempt.loads.body is None:
        attempt.state = await anyio.to_thread.run_sync(_decode_verified, header, body)
    else:
        try:
            attempt.state = await attempt.loads.body(header, body)
        except UnsupportedInputError as exc:  # committed and sound; it does not fit the destination
            attempt.refused = exc
    log.warning(
        "rank %d: restored step %d from rank %d's replica and committed it again locally (healed)",
        rs.rank,
        header.step,
        rs.send_to,
    )


async def _drop_newer(store: StepStore, rs: GroupSession, step: int) -> None:
    """Remove this rank's committed steps and held replicas newer than the agreed ``step``.

    Not every rank can restore them (or the ranks would have agreed on one), so no job can
    ever resume from them; removing them lets the resumed job save those step numbers again.
    """
    for newer in [s for s in store.steps() if s > step]:
        try:
            await store.delete(newer)
        except OSError as exc:
            log.warning("rank %d: cannot remove its step %d (still committed): %s", store.rank, newer, exc)
        else:
            log.warning("rank %d: removed its step %d: not every rank can restore it", store.rank, newer)
    held = await blocking_io(rs.held_replicas)
    for newer in sorted(s for s in held if s > step):
        try:
            await blocking_io(os.unlink, held[newer])
        except OSError as exc:
            log.warning("rank %d: cannot remove the replica %s: %s", rs.rank, held[newer], exc)
