"""A trainer and its control endpoint in one event loop, checkpointing through astage.

The trainer runs a small model on synthetic data.  An ASGI app (Starlette), served on
127.0.0.1 by hypercorn in the trainer's own event loop (asyncio or trio), lets an
orchestrator steer it without stopping training::

    POST /checkpoint         save at the next step boundary; replies once the state is staged
    POST /checkpoint?wait=1  ... and once that checkpoint is committed (with its stats)
    GET  /status             step, last checkpoint, saves in flight, the last save's stats
    GET  /checkpoints        the committed steps
    POST /shutdown           stop after the current step, finish in-flight saves, exit 0

Every reply is JSON; errors are ``{"error": "..."}`` with a 4xx/5xx status.

Run: ``python examples/checkpoint_service.py [--steps N] [--every K] [--directory D]
[--port P] [--backend asyncio|trio]`` (needs ``pip install "astage[service]"``, and
``astage[trio]`` for trio).  It prints ``listening on http://127.0.0.1:PORT`` once it
serves; started again with the same ``--directory``, it resumes from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import sniffio
import torch

import astage

try:
    from hypercorn.config import Config
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route
except ImportError as exc:  # the example's own dependencies, not astage's
    sys.exit(f"error: this example needs {exc.name}: pip install 'astage[service]'")

log = logging.getLogger("checkpoint_service")


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


# -- the control endpoint: an ASGI app ---------------------------------------------------


def create_app(trainer: Trainer) -> Starlette:
    """The control endpoint's routes, bound to ``trainer``; errors become JSON replies."""

    async def status(request: Request) -> Response:
        return JSONResponse(trainer.status())

    async def checkpoints(request: Request) -> Response:
        return JSONResponse({"steps": trainer.ckpt.steps(), "latest": trainer.ckpt.latest()})

    async def shutdown(request: Request) -> Response:
        # The trainer stops once the reply is out (a background task runs after sending).
        body = {"shutdown": True, "step": trainer.step}
        return JSONResponse(body, background=BackgroundTask(trainer.stop.set))

    async def checkpoint(request: Request) -> Response:
        if not trainer.running:
            raise HTTPException(503, "the trainer is not running")
        wanted = CheckpointRequest()
        trainer.pending.append(wanted)
        await wanted.done.wait()
        if wanted.handle is None:
            stopped = wanted.error == "the trainer has stopped"
            raise HTTPException(503 if stopped else 500, wanted.error or "")
        reply: dict[str, Any] = {"step": wanted.handle.step, "staged_seconds": wanted.handle.staging_seconds}
        if request.query_params.get("wait") == "1":
            try:
                stats = await wanted.handle.wait()
            except astage.AstageError as exc:
                raise HTTPException(500, str(exc)) from exc
            reply.update(committed=True, stats={**dataclasses.asdict(stats), "gbps": stats.gbps})
        return JSONResponse(reply)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return JSONResponse({"error": str(exc)}, status_code=500)

    routes = [
        Route("/checkpoint", checkpoint, methods=["POST"]),
        Route("/status", status, methods=["GET"]),
        Route("/checkpoints", checkpoints, methods=["GET"]),
        Route("/shutdown", shutdown, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})


def listen(port: int) -> socket.socket:
    """A listening socket on 127.0.0.1 (port 0: any free one), opened before serving starts.

    Opening it here lets the service print its port before hypercorn runs; connections made
    meanwhile wait in the backlog.
    """
    sock = socket.create_server(("127.0.0.1", port))
    return sock


async def serve_http(app: Starlette, sock: socket.socket, stop: Callable[[], Awaitable[Any]]) -> None:
    """Serve ``app`` on ``sock`` in this event loop until ``stop()`` returns, then drain.

    hypercorn has one ``serve`` per event loop library; the one of the running loop is used.
    Requests still open when ``stop()`` returns get up to ``graceful_timeout`` to finish.
    """
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]  # hypercorn takes the socket over and closes it
    config.loglevel = "WARNING"
    config.graceful_timeout = 10.0
    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve
    else:
        from hypercorn.asyncio import serve
    await serve(app, config, shutdown_trigger=stop)


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
        sock = listen(args.port)
        port = sock.getsockname()[1]
        drained = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(serve_http, create_app(trainer), sock, drained.wait)
            print(f"checkpoints in {directory}", flush=True)
            print(f"listening on http://127.0.0.1:{port}", flush=True)
            try:
                await trainer.run()
                await ckpt.wait()  # requests waiting for a commit get it before the server stops
            except astage.AstageError as exc:
                print(f"error: {exc}", file=sys.stderr, flush=True)
                failed = True
            finally:
                drained.set()
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
    parser.add_argument(
        "--backend",
        choices=["asyncio", "trio"],
        default="asyncio",
        help="event loop library (default asyncio)",
    )
    args = parser.parse_args()
    if args.backend == "trio":
        try:
            import trio  # noqa: F401  (anyio would only say "Backend 'trio' is not available")
        except ImportError:
            sys.exit("error: --backend trio needs trio: pip install 'astage[trio]'")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        sys.exit(anyio.run(serve, args, backend=args.backend))
    except astage.AstageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
