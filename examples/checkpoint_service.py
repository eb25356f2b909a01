"""A trainer and its control endpoint in one event loop, checkpointing through astage.

The trainer runs a small model on synthetic data.  A tiny HTTP/1.1 server on 127.0.0.1
(the same event loop, plain anyio streams, no framework) lets an orchestrator steer it
without stopping training::

    POST /checkpoint         save at the next step boundary; replies once the state is staged
    POST /checkpoint?wait=1  ... and once that checkpoint is committed (with its stats)
    GET  /status             step, last checkpoint, saves in flight, the last save's stats
    GET  /checkpoints        the committed steps
    POST /shutdown           stop after the current step, finish in-flight saves, exit 0

Run: ``python examples/checkpoint_service.py [--steps N] [--every K] [--directory D]
[--port P]``.  It prints ``listening on http://127.0.0.1:PORT`` once it serves; started
again with the same ``--directory``, it resumes from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import anyio.abc
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

import astage

log = logging.getLogger("checkpoint_service")

REQUEST_HEAD_CAP = 16 << 10
REQUEST_BODY_CAP = 64 << 10
CLIENT_TIMEOUT = 10.0
REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclasses.dataclass(eq=False)
class CheckpointRequest:
    """A "checkpoint now" waiting for the trainer's next step boundary."""

    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    handle: astage.SaveHandle | None = None
    error: str | None = None


class Trainer:
    """A small model trained on synthetic data, saved through a Checkpointer."""

    def __init__(self, ckpt: astage.Checkpointer, *, steps: int, every: int, step_seconds: float) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.ckpt = ckpt
        self.steps = steps
        self.every = every
        self.step_seconds = step_seconds
        self.step = 0
        self.loss = float("nan")
        self.running = False
        self.stop = anyio.Event()
        self.pending: list[CheckpointRequest] = []
        self.last_error: str | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.step}

    async def resume(self) -> None:
        """Continue from the latest committed checkpoint, if there is one."""
        latest = self.ckpt.latest()
        if latest is None:
            return
        state = await self.ckpt.restore(latest)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])
        self.step = state["step"]
        print(f"resumed from step {self.step}", flush=True)

    def train_step(self) -> None:
        x = torch.randn(32, 64)
        loss = (self.model(x) - x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.loss = float(loss.detach())
        self.step += 1

    async def run(self) -> None:
        """Train until ``steps`` or a shutdown request; checkpoint on schedule or on request."""
        self.running = True
        try:
            while self.step < self.steps and not self.stop.is_set():
                self.train_step()
                requests, self.pending = self.pending, []
                if requests or (self.every and self.step % self.every == 0):
                    await self.checkpoint(requests)
                await anyio.sleep(self.step_seconds)  # a real trainer awaits its data here
        finally:
            self.running = False
            for request in self.pending:
                request.error = "the trainer has stopped"
                request.done.set()

    async def checkpoint(self, requests: list[CheckpointRequest]) -> None:
        """Save now; ``save`` returns once staged, so training goes on at once."""
        handle: astage.SaveHandle | None = None
        error: str | None = None
        for _ in range(2):
            try:
                handle = await self.ckpt.save(self.step, self.state_dict())
                break
            except astage.PersistError as exc:  # an earlier save failed; this one did not happen yet
                self.last_error = error = str(exc)
                log.error("%s", exc)
            except astage.AstageError as exc:
                self.last_error = error = str(exc)
                break
        for request in requests:
            request.handle, request.error = handle, None if handle else error
            request.done.set()

    def status(self) -> dict[str, Any]:
        stats = self.ckpt.last_stats
        return {
            "step": self.step,
            "steps": self.steps,
            "training": self.running,
            "loss": None if math.isnan(self.loss) else self.loss,
            "last_checkpoint": self.ckpt.latest(),
            "in_flight": list(self.ckpt.in_flight),
            "last_save": None if stats is None else {**dataclasses.asdict(stats), "gbps": stats.gbps},
            "last_error": self.last_error,
        }


# -- the control endpoint ---------------------------------------------------------------


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_request(stream: anyio.abc.ByteStream) -> tuple[str, str, dict[str, list[str]]]:
    """Method, path and query of one HTTP/1.x request (its body is read and ignored)."""
    buffered = BufferedByteReceiveStream(stream)
    try:
        head = await buffered.receive_until(b"\r\n\r\n", REQUEST_HEAD_CAP)
    except anyio.DelimiterNotFound as exc:
        raise HttpError(400, "request head too large") from exc
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise HttpError(400, "malformed request line")
    method, target, _ = parts
    length = 0
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpError(400, "malformed header")
        if name.strip().lower() == "content-length":
            if not value.strip().isdigit() or int(value) > REQUEST_BODY_CAP:
                raise HttpError(400, "bad content-length")
            length = int(value)
    if length:
        await buffered.receive_exactly(length)
    url = urlsplit(target)
    return method, url.path, parse_qs(url.query)


ROUTES = {"/checkpoint": "POST", "/status": "GET", "/checkpoints": "GET", "/shutdown": "POST"}
"""Each endpoint and the one method it takes."""


class ControlEndpoint:
    """Routes requests to the trainer; one request per connection."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    async def handle(self, stream: anyio.abc.ByteStream) -> None:
        """Serve one connection; never raises (a failing handler must not stop the service)."""
        async with stream:
            shutdown = False
            try:
                with anyio.fail_after(CLIENT_TIMEOUT):
                    method, path, query = await read_request(stream)
                status, body = await self.route(method, path, query)
                shutdown = path == "/shutdown"
            except HttpError as exc:
                status, body = exc.status, {"error": str(exc)}
            except (TimeoutError, anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                return
            except Exception as exc:
                log.exception("request failed")
                status, body = 500, {"error": str(exc)}
            payload = json.dumps(body).encode()
            head = (
                f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
            )
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(head.encode("latin-1") + payload)
            if shutdown:
                self.trainer.stop.set()  # after the reply is out

    async def route(self, method: str, path: str, query: dict[str, list[str]]) -> tuple[int, dict[str, Any]]:
        if path not in ROUTES:
            raise HttpError(404, f"no such endpoint: {path}")
        if method != ROUTES[path]:
            raise HttpError(405, f"{path} takes {ROUTES[path]}")
        trainer = self.trainer
        if path == "/status":
            return 200, trainer.status()
        if path == "/checkpoints":
            return 200, {"steps": trainer.ckpt.steps(), "latest": trainer.ckpt.latest()}
        if path == "/shutdown":
            return 200, {"shutdown": True, "step": trainer.step}
        return await self.checkpoint_now(wait="1" in query.get("wait", []))

    async def checkpoint_now(self, *, wait: bool) -> tuple[int, dict[str, Any]]:
        trainer = self.trainer
        if not trainer.running:
            raise HttpError(503, "the trainer is not running")
        request = CheckpointRequest()
        trainer.pending.append(request)
        await request.done.wait()
        if request.handle is None:
            raise HttpError(503 if request.error == "the trainer has stopped" else 500, request.error or "")
        reply: dict[str, Any] = {
            "step": request.handle.step,
            "staged_seconds": request.handle.staging_seconds,
        }
        if wait:
            try:
                stats = await request.handle.wait()
            except astage.AstageError as exc:
                raise HttpError(500, str(exc)) from exc
            reply.update(committed=True, stats={**dataclasses.asdict(stats), "gbps": stats.gbps})
        return 200, reply


# -- main -------------------------------------------------------------------------------


def report(event: astage.SaveEvent) -> None:
    """The Checkpointer's progress callback: one line per commit or failure."""
    if event.kind == "committed" and event.stats is not None:
        s = event.stats
        print(
            f"committed step {s.step}: {s.nbytes / 1e6:.2f} MB, trainer blocked "
            f"{s.staging_seconds * 1e3:.1f} ms, persisted in {s.persist_seconds * 1e3:.1f} ms "
            f"({s.gbps:.2f} GB/s)",
            flush=True,
        )
    elif event.kind == "failed":
        print(f"checkpoint of step {event.step} failed: {event.error}", file=sys.stderr, flush=True)


async def serve(args: argparse.Namespace) -> int:
    directory = Path(args.directory or tempfile.mkdtemp(prefix="astage-service-"))
    failed = False
    async with astage.Checkpointer(directory, keep=args.keep, on_progress=report) as ckpt:
        trainer = Trainer(ckpt, steps=args.steps, every=args.every, step_seconds=args.step_seconds)
        await trainer.resume()
        endpoint = ControlEndpoint(trainer)
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=args.port)
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        # Connections outlive accepting: open requests get their answer before the exit.
        async with anyio.create_task_group() as connections, listener, anyio.create_task_group() as accepting:
            accepting.start_soon(listener.serve, endpoint.handle, connections)
            print(f"checkpoints in {directory}", flush=True)
            print(f"listening on http://127.0.0.1:{port}", flush=True)
            await trainer.run()
            try:
                await ckpt.wait()  # requests waiting for a commit get it
            except astage.AstageError as exc:
                print(f"error: {exc}", file=sys.stderr, flush=True)
                failed = True
            accepting.cancel_scope.cancel()
        print(f"stopped at step {trainer.step}; committed checkpoints: {ckpt.steps()}", flush=True)
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N steps; 0: on request only")
    parser.add_argument("--directory", help="checkpoint directory (default: a new temporary one)")
    parser.add_argument("--port", type=int, default=0, help="control port on 127.0.0.1 (default: any free)")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep (default 3)")
    parser.add_argument("--step-seconds", type=float, default=0.01, help="simulated data wait per step")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        sys.exit(anyio.run(serve, args))
    except astage.AstageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
