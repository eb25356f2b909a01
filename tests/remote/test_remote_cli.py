"""``astage ls URL`` and ``astage inspect URL`` on a remote tier, and the preemption example
(a real SIGTERM to a real training process, then a resume from the store alone)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import obstore
import pytest

import astage
from astage._remote.layout import commit_key, data_key
from astage.cli import main
from tests.remote.test_remote_tier import state
from tests.s3server import ACCESS_KEY, SECRET_KEY, SeaweedS3

ROOT = Path(__file__).resolve().parents[2]


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _save_steps(directory: Path, url: str, steps: list[int], **remote: object) -> None:
    async def go() -> None:
        async with astage.Checkpointer(directory, remote=astage.Remote(url, **remote), keep=None) as ckpt:  # type: ignore[arg-type]
            for step in steps:
                await (await ckpt.save(step, state(step))).uploaded()

    anyio.run(go)


def test_ls_and_inspect_a_file_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = (tmp_path / "store").as_uri()
    _save_steps(tmp_path / "a", url, [1, 2, 3])
    store = astage.Remote(url).client().store
    obstore.delete(store, commit_key(3, 0))  # step 3: data without its commit: incomplete
    code, out, _ = cli(["ls", url, "--json"], capsys)
    assert code == 0
    doc = json.loads(out)
    assert [(s["step"], s["complete"]) for s in doc["steps"]] == [(1, True), (2, True), (3, False)]
    assert doc["latest_complete"] == 2
    assert doc["verified"] is True
    assert all(s["nbytes"] > 0 for s in doc["steps"])
    code, out, _ = cli(["ls", url], capsys)
    assert code == 0
    assert "latest complete step 2" in out
    code, out, _ = cli(["inspect", f"{url}/{data_key(2, 0)}"], capsys)
    assert code == 0
    assert "checked against its commit object" in out
    # A corrupt object: ls says so and exits 1; inspect refuses it.
    data = bytearray(bytes(obstore.get(store, data_key(2, 0)).bytes()))
    data[-10] ^= 1
    obstore.put(store, data_key(2, 0), bytes(data))
    code, out, _ = cli(["ls", url, "--json"], capsys)
    assert code == 1
    assert json.loads(out)["latest_complete"] == 1
    code, _, err = cli(["inspect", f"{url}/{data_key(2, 0)}"], capsys)
    assert code == 2
    assert "does not match its commit object" in err


def test_ls_an_s3_prefix_with_credentials_from_the_environment(
    s3_server: SeaweedS3, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/run"
    _save_steps(
        tmp_path / "a",
        url,
        [5],
        options=s3_server.options(),
        client_options={"allow_http": True},
        chunk_nbytes=5 << 20,
    )
    for name, value in {
        "AWS_ENDPOINT_URL": s3_server.endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }.items():
        monkeypatch.setenv(name, value)
    code, out, err = cli(["ls", url, "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["latest_complete"] == 5
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    code, _, err = cli(["ls", url], capsys)
    assert code == 2
    assert "refused" in err
    assert "wrong-secret" not in err


def test_preemption_example_saves_and_uploads_on_sigterm(tmp_path: Path) -> None:
    store = (tmp_path / "store").as_uri()
    args = [sys.executable, "examples/preemption.py", "--remote", store, "--step-seconds", "0.02"]
    first = [*args, "--directory", str(tmp_path / "machine1")]
    with subprocess.Popen(first, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "no checkpoint on any tier: starting afresh"
        assert proc.stdout.readline().strip() == "training"
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "received SIGTERM" in out
    assert "uploaded step" in out
    step = int(out.split("uploaded step ", 1)[1].split(":", 1)[0])
    # Another machine, an empty disk: it resumes from the store alone.
    second = [*args, "--directory", str(tmp_path / "machine2"), "--steps", "1"]
    done = subprocess.run(second, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert f"resumed from step {step}" in done.stdout
