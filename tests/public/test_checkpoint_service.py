"""examples/checkpoint_service.py driven over loopback: a real process, real sockets, real files.

The service is an ASGI app served by hypercorn in the trainer's event loop; it is driven
here with httpx, plus raw bytes where the HTTP stack itself is under test.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

import astage

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "examples" / "checkpoint_service.py"


class Service:
    """The example service as a child process, and an HTTP client for its endpoint."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, output: bytes) -> None:
        self.proc = proc
        self.port = port
        self.output = output
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=15)

    def request(self, method: str, path: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        response = self.client.request(method, path, **kwargs)
        assert response.headers["content-type"] == "application/json"
        return response.status_code, response.json()

    def raw(self, data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=15) as sock:
            sock.sendall(data)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)

    def finish(self, timeout: float = 20) -> tuple[int, str, str]:
        self.client.close()
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, (self.output + out).decode(), err.decode()


@contextlib.contextmanager
def service(directory: Path, *args: str) -> Iterator[Service]:
    """Start the service and wait for its ``listening on`` line; kill it if the test fails."""
    proc = subprocess.Popen(
        [sys.executable, str(SERVICE), "--directory", str(directory), "--port", "0", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        output = b""
        deadline = time.monotonic() + 60
        while b"listening on http://127.0.0.1:" not in output:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"the service did not start: {output!r}"
            ready, _, _ = select.select([proc.stdout], [], [], remaining)
            chunk = os.read(proc.stdout.fileno(), 4096) if ready else b""
            assert chunk or proc.poll() is None, f"the service exited: {output!r}"
            output += chunk
        port = int(output.split(b"listening on http://127.0.0.1:")[1].split(b"\n")[0])
        svc = Service(proc, port, output)
        with svc.client:
            yield svc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


async def _restore(directory: Path) -> tuple[list[int], Any]:
    async with astage.Checkpointer(directory) as ckpt:
        return ckpt.steps(), await ckpt.restore()


def test_an_orchestrator_checkpoints_inspects_stops_and_resumes_the_service(tmp_path: Path) -> None:
    with service(tmp_path, "--steps", "1000000", "--every", "0", "--step-seconds", "0.002") as svc:
        status, body = svc.request("GET", "/status")
        assert status == 200
        assert body["training"] is True
        assert body["last_checkpoint"] is None
        assert body["in_flight"] == []

        status, body = svc.request("POST", "/checkpoint?wait=1")
        assert status == 200, body
        first = body["step"]
        assert body["committed"] is True
        assert body["stats"]["step"] == first
        assert body["stats"]["nbytes"] > 0

        status, body = svc.request("POST", "/checkpoint")  # replies once staged
        assert status == 200, body
        second = body["step"]
        assert second > first
        assert body["staged_seconds"] > 0

        deadline = time.monotonic() + 15
        while second not in (steps := svc.request("GET", "/checkpoints")[1])["steps"]:
            assert time.monotonic() < deadline, steps
            time.sleep(0.01)
        assert steps == {"steps": [first, second], "latest": second}

        status, body = svc.request("GET", "/status")
        assert body["step"] > second
        assert body["last_checkpoint"] == second
        assert body["last_save"]["step"] == second
        assert body["last_error"] is None

        assert svc.request("GET", "/nowhere") == (404, {"error": "Not Found"})
        assert svc.request("GET", "/checkpoint") == (405, {"error": "Method Not Allowed"})
        assert svc.raw(b"NONSENSE\r\n\r\n").startswith(b"HTTP/1.1 400 ")

        status, body = svc.request("POST", "/shutdown")
        assert status == 200
        assert body["shutdown"] is True
        code, out, err = svc.finish()
    assert code == 0, err
    assert f"committed step {second}" in out
    assert f"committed checkpoints: [{first}, {second}]" in out

    # Started again, it resumes from the latest checkpoint and stops after --steps.
    end = second + 8
    with service(tmp_path, "--steps", str(end), "--every", "4", "--step-seconds", "0", "--keep", "2") as svc:
        code, out, err = svc.finish()
    assert code == 0, err
    assert f"resumed from step {second}" in out
    assert f"stopped at step {end}; committed checkpoints: [{end - end % 4 - 4}, {end - end % 4}]" in out
    steps_on_disk, state = anyio.run(_restore, tmp_path)
    assert steps_on_disk == [end - end % 4 - 4, end - end % 4]
    assert state["step"] == end - end % 4
    assert set(state["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_service_speaks_http_1_1_on_either_event_loop(tmp_path: Path, backend: str) -> None:
    """Keep-alive, pipelining and chunked bodies work: a real HTTP stack, not a hand parser."""
    with service(
        tmp_path, "--steps", "1000000", "--every", "0", "--step-seconds", "0.002", "--backend", backend
    ) as svc:
        # Two pipelined requests on one connection are both answered, in order.
        status = b"GET /status HTTP/1.1\r\nHost: x\r\n\r\n"
        last = b"GET /checkpoints HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        replies = svc.raw(status + last)
        assert replies.count(b"HTTP/1.1 200 ") == 2, replies
        assert replies.rstrip().endswith(b'{"steps":[],"latest":null}'), replies

        # A chunked request body (Transfer-Encoding) is read and the request still served.
        status_code, body = svc.request("POST", "/checkpoint?wait=1", content=iter([b"{}", b"\n"]))
        assert status_code == 200, body
        assert body["committed"] is True

        # One client, one connection, several requests.
        for _ in range(3):
            assert svc.request("GET", "/status")[0] == 200
        assert svc.request("POST", "/shutdown")[1]["shutdown"] is True
        code, out, err = svc.finish()
    assert code == 0, err
    assert f"committed step {body['step']}" in out


def test_the_trio_backend_without_trio_says_what_to_install(tmp_path: Path) -> None:
    """A missing optional dependency is one line naming the extra, not a LookupError."""
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "trio.py").write_text("raise ImportError('trio is blocked for this test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, str(SERVICE), "--backend", "trio", "--directory", str(tmp_path / "d")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "pip install 'astage[trio]'" in done.stderr, done.stderr
