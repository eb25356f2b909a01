"""``python -m benchmarks.figures`` re-draws the performance figures from the benchmark JSON."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from benchmarks.figures import main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ["staging.svg", "loop_lag.svg", "replication.svg"]


def draw(out: Path, capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(["--out", str(out), *args]) == 0
    return capsys.readouterr().out.split()


def test_the_committed_results_draw_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    printed = draw(tmp_path, capsys)
    assert printed == [str(tmp_path / name) for name in FIGURES]
    for name in FIGURES:
        root = ET.parse(tmp_path / name).getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
    # Re-drawing the same results changes no byte (no date, fixed ids): refreshes diff cleanly.
    again = tmp_path / "again"
    draw(again, capsys)
    for name in FIGURES:
        assert (again / name).read_bytes() == (tmp_path / name).read_bytes()


def test_the_figures_show_what_the_json_says(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Renamed cases and a new date in the JSON appear in the drawings: they come from the data."""
    staging = json.loads((RESULTS / "staging.json").read_text())
    replication = json.loads((RESULTS / "replication.json").read_text())
    for payload in (staging, replication):
        payload["environment"]["date"] = "1999-12-31"
        for result in payload["results"]:
            result["case"] = "renamed-" + result["case"]
    (tmp_path / "s.json").write_text(json.dumps(staging))
    (tmp_path / "r.json").write_text(json.dumps(replication))
    out = tmp_path / "figs"
    draw(out, capsys, "--staging", str(tmp_path / "s.json"), "--replication", str(tmp_path / "r.json"))
    for name in FIGURES:
        text = (out / name).read_text()
        assert "1999-12-31" in text
        assert "renamed-small-20k" in text
    assert "torch DefaultStager" in (out / "loop_lag.svg").read_text()
    assert "raw write+fsync" in (out / "replication.svg").read_text()


def test_the_staging_results_carry_a_lag_series_per_method() -> None:
    """The loop-lag figure needs bench_staging's time series: (seconds, ms) beats in a stage."""
    results = json.loads((RESULTS / "staging.json").read_text())["results"]
    astage = [r for r in results if r["method"] == "astage"]
    assert astage
    for r in astage:
        assert r["lag_series"], r["case"]
        times = [t for t, _ in r["lag_series"]]
        assert times == sorted(times)
