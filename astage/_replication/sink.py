"""The receiving end of a replica: written and verified as it lands, committed only whole.

:class:`StreamingSink` is what :class:`astage.ReplicationStager` (and the collective
restore, through a subclass) hands the transport as its ``allocate``/``on_prefix``/
``on_chunk`` hooks; :func:`_retire_previous` and :func:`unlink_if_present` keep the replica a commit
replaces out of the commit's critical path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import anyio
import torch

from .._files.durable import BlockingWriter, CheckpointFileWriter, DirOpener, blocking_io, temp_path_for
from .._format.codec import BodyVerifier, FileHeader, byte_view, parse_prefix
from .._format.header_cache import HeaderCache
from .._staging.pool import BufferPool, Lease
from .._util.errors import IntegrityError, PersistError, one_error

log = logging.getLogger("astage.replication")


def _retire_previous(path: Path) -> Path | None:
    """Give the replica at ``path`` a second name, a temp-file one, before it is replaced.

    Replacing a file deletes the one it replaces, and deleting a large file (freeing and
    discarding its blocks) measured 0.1-0.2 s per 0.4 GB here, in the middle of the commit.
    With a second name the replace only drops a link; the caller deletes the old replica
    later, while it stages the next one.  ``None`` when there is no previous replica or the
    file system has no hard links (then the replace deletes it, as usual).
    """
    retired = temp_path_for(path)
    try:
        os.link(path, retired)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.debug("cannot link %s to %s (%s): replacing it will delete it", path, retired.name, exc)
        return None
    return retired


def unlink_if_present(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot remove the replaced replica %s: %s", path, exc)


class StreamingSink:
    """Writes and verifies a replica as the transport delivers it.

    The prefix is parsed (in a worker thread, through ``headers`` where given: a holder
    receives the same structure every save) as soon as it lands, and the body is received
    into a buffer of the stager's inbox pool (reused from call to call once nothing
    references the previous replica).  Each body chunk is written to the temp file and
    checked against its storages' checksums while the next ones are still on the wire, so
    persisting and verifying overlap receiving and no second pass over the body is needed.
    A disk or checksum error does not abort the transfer (that would break the group): the
    rest is drained and the error raised by :meth:`finish`, after which the peer is told.
    Nothing is renamed into place before the whole body has been verified.
    """

    def __init__(
        self,
        path: Path,
        owner_rank: int,
        inbox: BufferPool,
        *,
        open_dir: DirOpener | None = None,
        headers: HeaderCache | None = None,
    ) -> None:
        self.writer = CheckpointFileWriter(path, open_dir=open_dir)
        self.parse = parse_prefix if headers is None else headers.parse
        self.owner_rank = owner_rank
        self.inbox = inbox
        self.lease: Lease | None = None
        self.verifier: BodyVerifier | None = None  # set, with the header, by on_prefix
        self.error: Exception | None = None
        self.retired: Path | None = None  # the replica this one replaced, for the caller to delete

    async def on_prefix(self, prefix: bytes) -> None:
        # An IntegrityError here aborts the transfer: the peer is not speaking our format.
        header = await anyio.to_thread.run_sync(self.parse, prefix)
        if header.owner_rank != self.owner_rank:
            raise IntegrityError(
                f"expected rank {self.owner_rank}'s replica, the header says rank {header.owner_rank}"
            )
        self.verifier = BodyVerifier(header)
        if header.body_nbytes:
            self.lease = await self.inbox.acquire([header.body_nbytes])
        await self._write(memoryview(prefix), open_first=True)

    def allocate(self, nbytes: int) -> torch.Tensor:
        """The body buffer leased in :meth:`on_prefix` (the transport calls this next)."""
        _check_announced(self.verifier, self.owner_rank, nbytes)
        if self.lease is None:
            return torch.empty(0, dtype=torch.uint8)
        return torch.empty(0, dtype=torch.uint8).set_(self.lease.storages[0])

    async def on_chunk(self, offset: int, chunk: torch.Tensor) -> None:
        data = byte_view(chunk)
        # The write and the checksums read the same bytes, independently: run them at once.
        with one_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._write, data)
                tg.start_soon(self._verify, data)

    async def _verify(self, data: memoryview) -> None:
        assert self.verifier is not None
        if self.error is not None:  # after a mismatch the verifier is out of step: stop
            return
        try:
            await anyio.to_thread.run_sync(self.verifier.update, data)
        except IntegrityError as exc:
            self.error = self.error or exc

    async def _write(self, data: memoryview, *, open_first: bool = False) -> None:
        if self.error is not None:
            return
        try:
            if open_first:
                await self.writer.open()
            await self.writer.write(data)
        except PersistError as exc:
            self.error = self.error or exc

    async def finish(self) -> FileHeader:
        """Check the whole replica came in and verified, then make it durable."""
        if self.error is not None:
            raise self.error
        assert self.verifier is not None
        self.verifier.finish()
        retired = await blocking_io(_retire_previous, self.writer.path)
        try:
            await self.writer.commit()
        except BaseException:
            # Before the rename the extra name is only a link to the replica still in place;
            # after it (only the directory fsync failed) it is the old replica itself.
            if retired is not None:
                with anyio.CancelScope(shield=True):
                    await blocking_io(unlink_if_present, retired)
            raise
        self.retired = retired
        return self.verifier.header

    async def aclose(self) -> None:
        """Discard the temp file unless committed; the body buffer goes back to the inbox
        once nothing (the transport, a result, a decoded replica) references it."""
        with anyio.CancelScope(shield=True):
            await self.writer.aclose()
        if self.lease is not None:
            self.inbox.hand_out(self.lease)
            self.lease = None


class BlockingSink:
    """:class:`StreamingSink`'s work on the calling thread, for an exchange that needs no
    event loop (:mod:`astage._transport.blocking`): each chunk is written and checked as it
    lands; nothing is renamed into place before the whole body has been verified.

    :param body: returns a contiguous CPU ``uint8`` tensor of at least ``nbytes`` to
        receive the body into (the caller re-uses one from call to call).
    """

    def __init__(
        self,
        path: Path,
        owner_rank: int,
        parse: Callable[[bytes], FileHeader],
        body: Callable[[int], torch.Tensor],
    ) -> None:
        self.writer = BlockingWriter(path)
        self.parse = parse
        self.owner_rank = owner_rank
        self.body = body
        self.verifier: BodyVerifier | None = None
        self.error: Exception | None = None
        self.retired: Path | None = None

    def on_prefix(self, prefix: bytes) -> None:
        # An IntegrityError here aborts the transfer: the peer is not speaking our format.
        header = self.parse(prefix)
        if header.owner_rank != self.owner_rank:
            raise IntegrityError(
                f"expected rank {self.owner_rank}'s replica, the header says rank {header.owner_rank}"
            )
        self.verifier = BodyVerifier(header)
        try:
            self.writer.open()
            self.writer.write(memoryview(prefix))
        except PersistError as exc:
            self.error = exc

    def allocate(self, nbytes: int) -> torch.Tensor:
        _check_announced(self.verifier, self.owner_rank, nbytes)
        return self.body(nbytes)

    def on_chunk(self, offset: int, chunk: torch.Tensor) -> None:
        # A disk or checksum error does not abort the transfer (that would break the group):
        # the rest is drained and the error raised by finish().
        if self.error is not None:
            return
        assert self.verifier is not None
        data = byte_view(chunk)
        try:
            self.writer.write(data)
            self.verifier.update(data)
        except (PersistError, IntegrityError) as exc:
            self.error = exc

    def finish(self) -> FileHeader:
        """Check the whole replica came in and verified, then make it durable."""
        if self.error is not None:
            raise self.error
        assert self.verifier is not None
        self.verifier.finish()
        retired = _retire_previous(self.writer.path)
        try:
            self.writer.commit()
        except BaseException:
            if retired is not None:
                unlink_if_present(retired)
            raise
        self.retired = retired
        return self.verifier.header

    def close(self) -> None:
        """Discard the temp file unless committed."""
        self.writer.discard()


def _check_announced(verifier: BodyVerifier | None, owner_rank: int, nbytes: int) -> None:
    """The body size the transport announces must be the one the verified header says."""
    assert verifier is not None
    expected = verifier.header.body_nbytes
    if nbytes != expected:
        raise IntegrityError(f"rank {owner_rank} announces a {nbytes}-byte body, its header says {expected}")
