"""Every example and the ``astage`` command run end to end at a small size."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import pytest
import torch

from astage._files.durable import write_checkpoint_file
from astage._format.codec import encode
from astage.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the command in-process (the console script itself is exercised by the demo test)."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: --help and usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_async_training_loop_example() -> None:
    done = run("examples/async_training_loop.py", "--steps", "6", "--every", "3")
    assert done.returncode == 0, done.stderr
    assert "step 6: staged" in done.stdout
    assert "heartbeat lag during stage() only (1 ms beat; training steps excluded)" in done.stdout


def test_replication_example_loses_a_node_restarts_and_resumes_bit_exact(tmp_path: Path) -> None:
    done = run(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
        "examples/replication_torchrun.py", "--steps", "2", "--lose-rank", "1", "--directory", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rank 1: lost its node" in done.stdout
    for rank in (0, 1):
        assert f"rank {rank}: resumed from step 2, bit-exact" in done.stdout
        assert f"rank {rank}/2 step 4: committed" in done.stdout  # it saved again after resuming
    assert sorted(p.name for p in (tmp_path / "node1" / "ckpt").iterdir() if p.is_dir()) == [
        "step_0000000003",
        "step_0000000004",
    ]


def test_replication_example_without_torchrun_says_how_to_launch_it() -> None:
    done = run("examples/replication_torchrun.py")
    assert done.returncode == 2
    assert "torchrun --nproc-per-node 2" in done.stderr
    assert "Traceback" not in done.stderr


def test_cli_demo_runs_with_no_arguments() -> None:
    done = run("-m", "astage", "demo")
    assert done.returncode == 0, done.stderr
    assert "all checks passed" in done.stdout


def test_cli_demo_runs_again_on_the_same_directory_with_a_directory_per_rank(tmp_path: Path) -> None:
    for _ in range(2):
        done = run("-m", "astage", "demo", "--steps", "2", "--every", "1", "--directory", str(tmp_path))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "all checks passed" in done.stdout
    runs = list(tmp_path.iterdir())
    assert len(runs) == 2
    for run_dir in runs:  # no path shared between the ranks: one node directory each
        assert sorted(p.name for p in run_dir.iterdir()) == ["node0", "node1"]


@pytest.mark.parametrize("argv", [["--help"], *([c, "--help"] for c in ("demo", "inspect", "ls", "bench"))])
def test_cli_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = cli(argv, capsys)
    assert code == 0
    assert "usage: astage" in out


def test_cli_unknown_command_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = cli(["nonsense"], capsys)
    assert code == 2
    assert "invalid choice" in err


def write_small_replica(path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32)
    staged = {"w": base.view(3, 4), "row": base[4:8], "meta": {"step": 7}}
    anyio.run(
        write_checkpoint_file, path, encode(staged, owner_rank=1, holder_rank=0, step=7, checkpoint_id="c7")
    )


def test_cli_inspect_shows_header_tensors_and_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "r.astage"
    write_small_replica(path)
    code, out, err = cli(["inspect", str(path)], capsys)
    assert code == 0, err
    assert "replica of rank 1's step 7, kept by rank 0" in out
    assert "['row']" in out
    assert "checksums verified" in out


def test_cli_ls_lists_replicas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_small_replica(tmp_path / "r.astage")
    code, out, err = cli(["ls", str(tmp_path)], capsys)
    assert code == 0, err
    assert "r.astage" in out


def test_cli_inspect_of_a_corrupt_file_is_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "r.astage"
    write_small_replica(path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    code, _, err = cli(["inspect", str(path)], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "checksum" in err


def test_cli_inspect_of_a_missing_file_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = cli(["inspect", str(tmp_path / "nope.astage")], capsys)
    assert code == 2
    assert "No such file" in err
