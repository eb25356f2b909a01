"""The benchmarks run end to end at their smoke-test size (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_staging_quick_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_staging", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for header in ("method", "first s", "steady s", "x ceiling", "peak RSS MB", "lag p99 ms", "lag max ms"):
        assert header in done.stdout
    for row in ("ceiling (copy_)", "astage", "torch DefaultStager", "torch Blocking", "PASS|MISS"):
        assert any(part in done.stdout for part in row.split("|"))
    results = json.loads(out.read_text())["results"]
    assert {r["case"] for r in results} == {"gpt2-adam", "small-20k"}


def test_bench_replication_quick_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_replication", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    for header in ("method", "median s", "min s", "GB/s", "x astage", "astage phases"):
        assert header in done.stdout
    for row in ("astage", "raw exchange", "raw write+fsync", "torch _ReplicationStager"):
        assert row in done.stdout
    for row in ("astage restore (lost rank)", "raw send (holder -> lost rank)", "raw send + raw write+fsync"):
        assert row in done.stdout
    assert "PASS" in done.stdout or "MISS" in done.stdout
    results = json.loads(out.read_text())["results"]
    assert {r["case"] for r in results} == {"gpt2-like", "small-20k", "restore"}
