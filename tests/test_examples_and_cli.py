"""Every example and the ``astage`` command run end to end at a small size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_async_training_loop_example() -> None:
    done = run("examples/async_training_loop.py", "--steps", "6", "--every", "3")
    assert done.returncode == 0, done.stderr
    assert "step 6: staged" in done.stdout
    assert "heartbeat lag" in done.stdout


def test_cli_demo_runs_with_no_arguments() -> None:
    done = run("-m", "astage", "demo")
    assert done.returncode == 0, done.stderr
    assert "isolated from training" in done.stdout


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"]])
def test_cli_help(argv: list[str]) -> None:
    done = run("-m", "astage", *argv)
    assert done.returncode == 0
    assert "usage: astage" in done.stdout


def test_cli_unknown_command_fails_cleanly() -> None:
    done = run("-m", "astage", "nonsense")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
