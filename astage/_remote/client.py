"""The object-store client of the remote tier: ``obstore`` behind a few checked operations.

Every operation runs ``obstore``'s blocking call in a worker thread (the Rust client does
the network I/O without the GIL): the event loop is never held, the same code serves
asyncio and trio (``obstore``'s awaitables need an asyncio loop), and a transfer streams
between the local file and the store on one thread, chunk by chunk, with no turn of the
loop per chunk.  Uploads read the committed local file in ``chunk_nbytes`` pieces and
hand them to a multipart upload (``max_concurrency`` parts in flight), computing the
object's crc32c on the way; downloads write into a temp file in the step directory,
checking size and crc32c before it is renamed into place.  A cancelled transfer stops at
its next chunk (its thread is abandoned, never waited for; it closes what it opened).

Errors are translated at this boundary: :class:`~astage.RemoteError` names the store's
URL (never a credential), the operation and the key, and says whether trying again may
help (``transient``: 5xx, resets, timeouts) or not (credentials, a missing bucket).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio
import crc32c
import obstore
import obstore.exceptions as obx
from obstore.store import from_url

from .._files.durable import create_new, temp_path_for
from .._util.errors import IntegrityError, RemoteError

if TYPE_CHECKING:
    from .config import Remote

log = logging.getLogger("astage.remote")

T = TypeVar("T")

_PERMANENT: Final = (
    obx.PermissionDeniedError,
    obx.UnauthenticatedError,
    obx.InvalidPathError,
    obx.NotSupportedError,
    obx.UnknownConfigurationKeyError,
    obx.PreconditionError,
    obx.AlreadyExistsError,
)
_PERMANENT_WORDS: Final = (
    "NoSuchBucket",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    " 403 ",
)


class Cancelled(Exception):
    """A transfer's thread stopped because its caller went away (never reaches a user)."""


class TransientRemoteError(RemoteError):
    """A failure that trying again may cure (5xx, a reset, a timeout)."""


def _translate(exc: BaseException, url: str, operation: str, key: str) -> RemoteError:
    message = str(exc).split("\n", 1)[0][:400]
    where = f"{operation} {key!r} on {url}"
    if isinstance(exc, FileNotFoundError | obx.NotFoundError):
        return RemoteError(f"{where}: not found (is the bucket there?): {message}")
    if isinstance(exc, _PERMANENT) or any(word in str(exc) for word in _PERMANENT_WORDS):
        return RemoteError(f"{where} was refused (credentials, permissions or bucket): {message}")
    return TransientRemoteError(f"{where} failed: {message}")


def _store_config(remote: Remote) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The store's options, the HTTP client's and the retry config, defaults filled in."""
    client: dict[str, Any] = {"connect_timeout": timedelta(seconds=10), "timeout": timedelta(seconds=120)}
    # Passing client options replaces those the store would read from the environment:
    # the one that matters for an S3-compatible store on plain http is read here again.
    if os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true") and remote.scheme in ("s3", "s3a"):
        client["allow_http"] = True
    client.update(remote.client_options)
    retry: dict[str, Any] = {
        "max_retries": 4,
        "backoff": {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=5)},
        "retry_timeout": timedelta(seconds=min(remote.deadline, 120.0)),
    }
    return dict(remote.options), client, retry


class RemoteClient:
    """One store (a :class:`Remote`'s URL) and the operations the remote tier makes on it."""

    def __init__(self, remote: Remote) -> None:
        self.url = remote.shown
        self.chunk_nbytes = remote.chunk_nbytes
        self.max_concurrency = remote.max_concurrency
        options, client, retry = _store_config(remote)
        extra: dict[str, Any] = {"mkdir": True} if remote.scheme == "file" else {}
        if remote.scheme == "memory":
            self.store: Any = from_url(remote.url)
        elif remote.scheme == "file":
            self.store = from_url(remote.url, **extra)
        else:
            try:
                make: Callable[..., Any] = from_url  # the options are the caller's: checked by obstore
                self.store = make(remote.url, client_options=client, retry_config=retry, **options)
            except Exception as exc:
                raise RemoteError(f"cannot configure the store {self.url}: {str(exc)[:300]}") from exc

    async def run(
        self, operation: str, key: str, fn: Callable[..., T], *args: Any, owns: int | None = None
    ) -> T:
        """Run the blocking ``fn(*args)`` in a worker thread; errors as :class:`RemoteError`.

        Cancelled, the thread is abandoned (a transfer stops at its next chunk).  ``owns``
        is a descriptor ``fn`` closes: if ``fn`` never starts (cancelled while waiting for
        a thread), it is closed here instead, exactly once either way.
        """
        claim = _Claim(owns)
        call = functools.partial(fn, *args)
        try:
            return await anyio.to_thread.run_sync(
                _guarded, call, claim, self.url, operation, key, abandon_on_cancel=True
            )
        except BaseException:
            claim.abandon()
            raise

    # -- the blocking operations (each in a worker thread, through run) --------------------

    def put_bytes(self, key: str, data: bytes, cancel: threading.Event) -> None:
        obstore.put(self.store, key, data, use_multipart=False)

    def claim(self, key: str, data: bytes, cap: int, cancel: threading.Event) -> bytes:
        """Create ``key`` with ``data`` unless it exists; what it holds afterwards."""
        try:
            obstore.put(self.store, key, data, mode="create")
            return data
        except (obx.AlreadyExistsError, obx.PreconditionError):
            return self.get_bytes(key, cap, cancel)

    def get_bytes(self, key: str, cap: int, cancel: threading.Event) -> bytes:
        """The object at ``key`` if it is at most ``cap`` bytes.

        :raises IntegrityError: it is larger.
        """
        meta = obstore.head(self.store, key)
        if meta["size"] > cap:
            raise IntegrityError(f"{key} on {self.url} is {meta['size']} bytes, over the {cap}-byte cap")
        data = bytes(obstore.get(self.store, key).bytes())
        if len(data) > cap:
            raise IntegrityError(f"{key} on {self.url} grew over the {cap}-byte cap while read")
        return data

    def size(self, key: str, cancel: threading.Event) -> int | None:
        """The object's size, ``None`` if there is none."""
        try:
            return int(obstore.head(self.store, key)["size"])
        except (FileNotFoundError, obx.NotFoundError):
            return None

    def listing(self, cancel: threading.Event) -> list[tuple[str, int]]:
        """Every ``(key, size)`` under the prefix."""
        out: list[tuple[str, int]] = []
        for batch in obstore.list(self.store, chunk_size=1000):
            if cancel.is_set():
                raise Cancelled("listing abandoned")
            out += [(str(meta["path"]), int(meta["size"])) for meta in batch]
        return out

    def delete(self, key: str, cancel: threading.Event) -> None:
        with contextlib.suppress(FileNotFoundError, obx.NotFoundError):
            obstore.delete(self.store, key)

    def upload_file(self, key: str, fd: int, nbytes: int, cancel: threading.Event) -> int:
        """Upload ``nbytes`` of the open file ``fd`` (closed here) to ``key``; its crc32c.

        Multipart once larger than one chunk; memory held is about
        ``chunk_nbytes * (max_concurrency + 1)``.

        :raises IntegrityError: the file is not ``nbytes`` long.
        """
        crc = [0]
        read = [0]
        chunk = self.chunk_nbytes

        def chunks() -> Iterator[bytes]:
            offset = 0
            while offset < nbytes:
                if cancel.is_set():
                    raise Cancelled("upload abandoned")
                data = os.pread(fd, min(chunk, nbytes - offset), offset)
                if not data:
                    raise IntegrityError(f"the local file for {key} ended at {offset} of {nbytes} bytes")
                crc[0] = crc32c.crc32c(data, crc[0])
                offset += len(data)
                read[0] = offset
                yield data

        try:
            if os.fstat(fd).st_size != nbytes:
                raise IntegrityError(f"the local file for {key} is not {nbytes} bytes")
            if nbytes <= chunk:
                obstore.put(self.store, key, b"".join(chunks()), use_multipart=False)
            else:
                obstore.put(
                    self.store,
                    key,
                    chunks(),
                    use_multipart=True,
                    chunk_size=chunk,
                    max_concurrency=self.max_concurrency,
                )
        finally:
            os.close(fd)
        if read[0] != nbytes:
            raise IntegrityError(f"uploaded {read[0]} of {nbytes} bytes of {key}")
        return int(crc[0])

    def download(
        self, key: str, dir_fd: int, name: str, nbytes: int, crc: int | None, cancel: threading.Event
    ) -> None:
        """Download ``key`` into ``name`` in the directory ``dir_fd`` (closed here), durably.

        Written to a temp file first; renamed into place only once exactly ``nbytes``
        arrived with the crc32c ``crc`` (and fsynced); a failure leaves no file behind.

        :raises IntegrityError: the object is not ``nbytes`` long or its crc32c differs.
        """
        temp = temp_path_for(Path(name)).name
        fd = -1
        try:
            fd = create_new(temp, dir_fd)
            got, running = 0, 0
            for piece in obstore.get(self.store, key).stream(min_chunk_size=self.chunk_nbytes):
                if cancel.is_set():
                    raise Cancelled("download abandoned")
                view = memoryview(piece)
                got += len(view)
                if got > nbytes:
                    raise IntegrityError(
                        f"{key} on {self.url} is longer than its commit object's {nbytes} bytes"
                    )
                running = crc32c.crc32c(view, running)
                while view:
                    view = view[os.write(fd, view) :]
            if got != nbytes or (crc is not None and running != crc):
                raise IntegrityError(
                    f"{key} on {self.url} does not match its commit object "
                    f"({got} of {nbytes} bytes, crc32c {running:#010x} vs {crc})"
                )
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.fsync(dir_fd)
            temp = ""
        finally:
            if fd >= 0:
                os.close(fd)
            if temp:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp, dir_fd=dir_fd)
            os.close(dir_fd)


class _Claim:
    """Who closes a descriptor handed to a worker: the worker once it starts, else the caller."""

    def __init__(self, fd: int | None) -> None:
        self.cancel = threading.Event()
        self._fd = fd
        self._lock = threading.Lock()
        self._state = "pending"

    def start(self) -> bool:
        """In the worker: whether to run (the caller has not given up first)."""
        with self._lock:
            if self._state == "closed":
                return False
            self._state = "running"
            return True

    def abandon(self) -> None:
        """In the caller, once it gave up: stop the worker, or close what it never took."""
        self.cancel.set()
        with self._lock:
            if self._state == "pending" and self._fd is not None:
                os.close(self._fd)
            self._state = "closed" if self._state == "pending" else self._state


def _guarded(call: Callable[[threading.Event], T], claim: _Claim, url: str, operation: str, key: str) -> T:
    if not claim.start():
        raise Cancelled(f"{operation} {key!r} abandoned before it started")
    try:
        return call(claim.cancel)
    except (IntegrityError, RemoteError, Cancelled):
        raise
    except obx.BaseError as exc:
        raise _translate(exc, url, operation, key) from exc
    except (FileNotFoundError, ConnectionError, TimeoutError) as exc:
        raise _translate(exc, url, operation, key) from exc
