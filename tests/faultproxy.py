"""A small fault-injecting TCP proxy on 127.0.0.1, in front of the test S3 server.

It runs its own asyncio loop in a thread (so tests under any anyio backend can use it) and
forwards each connection byte for byte, unless told to misbehave:

* ``fail_connections = n``: the next ``n`` connections get ``HTTP/1.1 503`` to their first
  request and are closed (an overloaded store);
* ``reset_after = nbytes``: a connection is cut (both ways) once it has carried ``nbytes``
  from the client, once (a reset in the middle of an upload);
* ``delay = seconds``: every chunk forwarded waits that long first (a slow store);
* ``refuse = True``: every new connection gets 503 (a store that stays down).

``uploaded`` counts the bytes forwarded from clients to the server, and
:meth:`wait_uploaded` waits (on a condition, not a clock) until it reaches a mark.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

_RESPONSE_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nContent-Length: 90\r\n"
    b"Connection: close\r\n\r\n"
    b"<Error><Code>SlowDown</Code><Message>injected by the test proxy</Message></Error>".ljust(90)
)


class FaultProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target``, injecting the faults it is told."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.fail_connections = 0
        self.refuse = False
        self.reset_after: int | None = None
        self.delay = 0.0
        self.uploaded = 0
        self.injected = 0
        self._cond = threading.Condition()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="fault proxy", daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_uploaded(self, nbytes: int, timeout: float = 60.0) -> bool:
        """Wait until clients have sent at least ``nbytes`` through the proxy."""
        with self._cond:
            return self._cond.wait_for(lambda: self.uploaded >= nbytes, timeout)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(30)

    def stop(self) -> None:
        """Close every connection and the listener, then end the proxy's loop."""
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for writer in list(self._writers):
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # cancelled only by stop()
            await self._serve(reader, writer)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        if self.refuse or self.fail_connections > 0:
            self.fail_connections = max(0, self.fail_connections - 1)
            self.injected += 1
            with contextlib.suppress(OSError):
                await reader.read(65536)
                writer.write(_RESPONSE_503)
                await writer.drain()
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers.add(up_writer)
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer, upstream=True)),
            asyncio.ensure_future(self._pump(up_reader, writer, upstream=False)),
        ]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for task in pumps:
            task.cancel()
        for w in (writer, up_writer):
            with contextlib.suppress(OSError):
                w.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, upstream: bool
    ) -> None:
        carried = 0
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(1 << 16):
                if upstream and self.refuse:
                    return  # a kept-alive connection is cut: the next one gets 503
                if self.delay:
                    await asyncio.sleep(self.delay)  # the injected slowness itself
                writer.write(data)
                await writer.drain()
                if upstream:
                    carried += len(data)
                    with self._cond:
                        self.uploaded += len(data)
                        self._cond.notify_all()
                    if self.reset_after is not None and carried >= self.reset_after:
                        self.reset_after = None
                        self.injected += 1
                        return  # both directions are closed by the handler


@contextlib.contextmanager
def fault_proxy(target: int) -> Iterator[FaultProxy]:
    proxy = FaultProxy(target)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
