"""The remote-tier benchmark runs end to end at its smallest size and prints its table."""

from __future__ import annotations

import json
from pathlib import Path

from tests.public.test_benchmarks_smoke import run_bench


def test_bench_remote_quick_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = run_bench("bench_remote", "--quick", "--json", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    for header in ("upload s", "raw put s", "x raw tput", "restore s", "raw get+load s", "save() ms"):
        assert header in done.stdout
    results = json.loads(out.read_text())["results"]
    assert {r["case"] for r in results} == {"gpt2-like", "small-20k"}
    for r in results:
        assert r["upload_s"] > 0
        assert r["raw_put_s"] > 0
        assert r["restore_s"] > 0
        assert r["nbytes"] > 0
