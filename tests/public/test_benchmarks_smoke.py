"""The benchmarks run end to end at their smoke-test size (no timing is asserted)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
GPU_VALIDATE = ROOT / "benchmarks" / "gpu_validate.sh"


def run_bench(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.<module> <args>`` from the checkout, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_bench_staging_quick_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = run_bench("bench_staging", "--quick", "--json", str(out), timeout=240)
    assert done.returncode == 0, done.stderr
    for header in ("method", "first s", "steady s", "x ceiling", "peak RSS MB", "lag p99 ms", "lag max ms"):
        assert header in done.stdout
    for row in ("ceiling (copy_)", "astage", "torch DefaultStager", "torch Blocking", "PASS|MISS"):
        assert any(part in done.stdout for part in row.split("|"))
    payload = json.loads(out.read_text())
    cases = {"gpt2-adam", "small-20k", "moe-20k", "lora", "trainer-20k", "dtensor-20k"}
    assert {r["case"] for r in payload["results"]} == cases
    assert set(payload["targets"]) == cases | {"checkpointer-save"}
    for case in cases:
        for method in ("astage", "torch DefaultStager"):
            for phase in ("first", "steady"):
                series = payload["lag_series"][case][method][phase]
                assert len(series["t_s"]) == len(series["lag_ms"])
                assert series["stage_s"] > 0
    assert "(moe-20k)" in done.stdout
    assert "Checkpointer.save (caller blocked)" in done.stdout
    save = payload["checkpointer"]
    assert save["tensors"] == 200
    assert len(save["blocked_runs_s"]) == len(save["ceiling_runs_s"]) == 3  # first + 2 runs
    incremental = [t for t in payload["targets"]["lora"] if "skip_unchanged steady" in t["target"]]
    assert len(incremental) == 1
    if incremental[0]["value"] is None:  # the core has no skip_unchanged yet: a clean n/a
        assert "n/a (skip_unchanged not available)" in done.stdout
        assert incremental[0]["pass"] is None
    else:
        assert any(r["method"] == "astage skip_unchanged" for r in payload["results"])
    results = payload["results"]
    assert payload["environment"]["cpus"] == os.cpu_count()
    # torch's blocking stager holds the loop for its whole (~10 ms) gpt2-adam stage: the
    # overdue beat is recorded in the lag series that docs/performance.md draws.
    blocking = next(r for r in results if r["method"] == "torch Blocking" and r["case"] == "gpt2-adam")
    assert blocking["lag_series"]


def test_bench_replication_quick_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = run_bench("bench_replication", "--quick", "--json", str(out), timeout=180)
    assert done.returncode == 0, done.stderr
    for header in ("method", "median s", "min s", "GB/s", "x astage", "astage phases"):
        assert header in done.stdout
    for row in ("astage", "raw exchange", "raw write+fsync", "torch _ReplicationStager"):
        assert row in done.stdout
    assert "overlap floor max(raw exchange, raw write+fsync)" in done.stdout
    assert "PASS" in done.stdout or "MISS" in done.stdout
    payload = json.loads(out.read_text())
    results = {r["case"]: r for r in payload["results"]}
    assert set(results) >= {"gpt2-like", "small-20k"}
    for case in ("gpt2-like", "small-20k"):
        runs = results[case]["runs_s"]
        floor = runs["overlap floor max(raw exchange, raw write+fsync)"]
        raw = zip(runs["raw exchange"], runs["raw write+fsync"], strict=True)
        assert floor == [max(x, w) for x, w in raw]
        names = {t["target"] for t in payload["targets"][case]}
        assert "astage / overlap floor (overlap target)" in names
    small = {t["target"] for t in payload["targets"]["small-20k"]}
    assert "torch _ReplicationStager / astage (overlap target)" in small
    for row in ("astage restore (lost rank)", "raw send (holder -> lost rank)", "raw send + raw write+fsync"):
        assert row in done.stdout
    assert set(results) == {"gpt2-like", "small-20k", "restore"}


def test_bench_gpu_without_cuda_says_so_and_exits_cleanly() -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the benchmark would run for real")
    done = run_bench("bench_gpu", "--quick", timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout
    assert "Traceback" not in done.stderr


def test_gpu_validate_script_parses() -> None:
    done = subprocess.run(
        ["bash", "-n", str(GPU_VALIDATE)], capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 0, done.stderr


def _gpu_validate(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run ``gpu_validate.sh --dry-run`` into ``tmp_path``; the process and the report's text."""
    environ = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        # Quick settings, in case this machine has a GPU and the benchmark runs for real.
        "ASTAGE_GPU_BENCH_ARGS": "--quick --case small-20k --runs 1",
        **env,
    }
    done = subprocess.run(
        ["bash", str(GPU_VALIDATE), "--dry-run", "--out", str(tmp_path / "results")],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    reports = list((tmp_path / "results").glob("gpu-*.md"))
    assert len(reports) == 1, (done.stdout, done.stderr)
    assert re.fullmatch(r"gpu-\d{4}-\d{2}-\d{2}\.md", reports[0].name)
    copied = tmp_path / "out" / reports[0].name
    assert copied.read_text() == reports[0].read_text()  # handed back through $OUT
    return done, reports[0].read_text()


def test_gpu_validate_dry_run_writes_the_report(tmp_path: Path) -> None:
    # test_pool.py holds a GPU-marked test: the summary line is a real pytest one.
    done, report = _gpu_validate(tmp_path, ASTAGE_GPU_TESTS="tests/staging/test_pool.py")
    assert done.returncode == 0, done.stderr
    for section in ("## Machine", "## Environment setup: skipped (dry run)", "## GPU-marked tests"):
        assert section in report
    assert re.search(r"Summary: .*\d+ (passed|skipped)", report)
    assert f"torch: {torch.__version__}" in report
    if torch.cuda.is_available():
        assert "(small-20k)" in report
    else:
        assert "## GPU staging benchmark" in report
        assert "no CUDA device" in report


def test_gpu_validate_reports_a_failed_phase_and_goes_on(tmp_path: Path) -> None:
    done, report = _gpu_validate(
        tmp_path, ASTAGE_GPU_TESTS="tests/no_such_test_file.py", ASTAGE_GPU_BENCH_ARGS="--case no-such-case"
    )
    assert done.returncode == 0, done.stderr
    assert re.search(r"## GPU-marked tests .*: failed \(exit status 4\)", report)
    assert re.search(r"## GPU staging benchmark .*: failed \(exit status 2\)", report)
    assert "invalid choice" in report  # the failing phase's own output is kept


def test_bench_format_quick_prints_the_cost_a_tensor() -> None:
    done = run_bench("bench_format", "--quick", timeout=120)
    assert done.returncode == 0, done.stderr
    for step in ("lay_out", "encode", "relabel", "parse_prefix", "decode"):
        assert step in done.stdout


def test_bench_loop_held_quick_prints_both_variants_and_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = run_bench("bench_loop_held", "--quick", "--json", str(out), timeout=180)
    assert done.returncode == 0, done.stderr
    for text in ("step on the loop", "step on the thread", "save->durable", "save() ms", "PASS|MISS"):
        assert any(part in done.stdout for part in text.split("|")), text
    payload = json.loads(out.read_text())
    assert [r["ranks"] for r in payload["results"]] == [1, 2]
    for result in payload["results"]:
        for variant in ("loop", "thread"):
            assert result["timings"][variant]["durable_s"]
            assert all(t > 0 for t in result["timings"][variant]["durable_s"])
        assert result["durable_ratio"] > 0


def test_bench_restore_quick_prints_every_method_and_the_targets(tmp_path: Path) -> None:
    out = tmp_path / "restore.json"
    done = run_bench("bench_restore", "--quick", "--json", str(out), timeout=600)
    assert done.returncode == 0, done.stderr
    for method in (
        "raw read",
        "torch.load(mmap)",
        "safetensors + load_state_dict",
        "DCP load (in place)",
        "astage restore()",
        "astage restore(into=)",
        "preadv lanes",
        "mmap + copy",
        "raw write+fsync",
        "astage first save",
        "astage steady save",
    ):
        assert method in done.stdout, method
    assert "restore(into=) peak RSS growth" in done.stdout
    assert re.search(r"astage restore\(into=\) / safetensors \+ load_state_dict: [\d.]+x", done.stdout)
    payload = json.loads(out.read_text())
    assert {c["case"] for c in payload["cases"]} == {"gpt2-adam"}  # quick: one input
    for case in payload["cases"]:
        into = case["results"]["astage restore(into=)"]
        assert into["seconds"] > 0
        assert into["lag_max_ms"] is not None


def test_bench_restore_gpu_without_cuda_says_so_and_exits_cleanly() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: gpu_validate.sh runs the real thing")
    done = run_bench("bench_restore", "--gpu", "--quick", timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stdout


def test_bench_first_stage_gc_quick_reports_the_collections_of_first_and_steady_stages() -> None:
    done = run_bench("bench_first_stage_gc", "--quick", timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert {"steady_lag_max_ms", "steady_full_passes"} <= set(report)
