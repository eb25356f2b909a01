"""examples/checkpoint_service.py driven over loopback: a real process, real sockets, real files."""

from __future__ import annotations

import contextlib
import http.client
import json
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

import astage

ROOT = Path(__file__).resolve().parent.parent
SERVICE = ROOT / "examples" / "checkpoint_service.py"


class Service:
    """The example service as a child process, and an HTTP client for its endpoint."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, output: bytes) -> None:
        self.proc = proc
        self.port = port
        self.output = output

    def request(self, method: str, path: str) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=15)
        try:
            conn.request(method, path)
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def raw(self, data: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=15) as sock:
            sock.sendall(data)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)

    def finish(self, timeout: float = 20) -> tuple[int, str, str]:
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
        yield Service(proc, port, output)
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

        assert svc.request("GET", "/nowhere")[0] == 404
        assert svc.request("GET", "/checkpoint")[0] == 405
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
