"""Draw the performance figures of ``docs/performance.md`` from the benchmarks' JSON results.

Reads what ``bench_staging --json`` and ``bench_replication --json`` wrote (by default the
committed ``benchmarks/results/staging.json`` and ``replication.json``) and writes three SVG
files, so refreshing the docs after a new measurement is one command::

    python -m benchmarks.bench_staging --json benchmarks/results/staging.json
    python -m benchmarks.bench_replication --json benchmarks/results/replication.json
    python -m benchmarks.figures            # -> docs/figures/*.svg

* ``staging.svg``: first and steady stage time of every method, by workload, against the
  ``copy_`` ceiling and torch's stagers;
* ``loop_lag.svg``: the event-loop heartbeat's lag over one stage, astage against torch;
* ``replication.svg``: one replication round against raw exchange, raw write+fsync (and
  their sum) and torch's ``_ReplicationStager``.

Needs matplotlib (``pip install "astage[figures]"``).  The SVG files carry no date and use
fixed ids, so re-drawing unchanged results changes no byte.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ROOT / "docs" / "figures"
COLORS = {
    "ceiling (copy_)": "#9e9e9e",
    "astage": "#1f77b4",
    "torch DefaultStager": "#ff7f0e",
    "torch Blocking": "#d62728",
    "raw exchange": "#bdbdbd",
    "raw write+fsync": "#8c8c8c",
    "raw exchange + raw write+fsync": "#5f5f5f",
    "torch _ReplicationStager": "#ff7f0e",
}


def _subtitle(payload: dict[str, Any]) -> str:
    env = payload.get("environment", {})
    return (
        f"{env.get('date', '?')}, {env.get('cpus', '?')} CPUs {env.get('machine', '')}, "
        f"accelerator: {env.get('accelerator', '?')}, torch {env.get('torch', '?')}; "
        f"scale {payload['scale']}, medians of {payload['runs']} runs"
    )


def _by_case(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    cases: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        cases.setdefault(r["case"], []).append(r)
    return cases


def _title(case: str, first: dict[str, Any]) -> str:
    # bench_replication's restore case records bytes only (a lost rank's whole state).
    tensors = first.get("tensors")
    return f"{case}: {first['bytes'] / 1e6:.1f} MB" + ("" if tensors is None else f", {tensors} tensors")


def draw_staging(payload: dict[str, Any], out: Path) -> None:
    """First and steady stage time per method, one panel per workload."""
    import matplotlib.pyplot as plt

    cases = _by_case(payload["results"])
    fig, axes = plt.subplots(1, len(cases), figsize=(5.2 * len(cases), 3.8), squeeze=False)
    for ax, (case, rows) in zip(axes[0], cases.items(), strict=True):
        names = [r["method"] for r in rows]
        ys = range(len(rows))
        first = [r["first_s"] * 1e3 for r in rows]
        steady = [r["steady_s"] * 1e3 for r in rows]
        colors = [COLORS.get(n, "#444444") for n in names]
        ax.barh([y + 0.2 for y in ys], first, height=0.4, color=colors, alpha=0.45, label="first stage")
        ax.barh([y - 0.2 for y in ys], steady, height=0.4, color=colors, label="steady stage")
        for y, f, s in zip(ys, first, steady, strict=True):
            ax.text(f, y + 0.2, f" {f:.1f}", va="center", fontsize=7)
            ax.text(s, y - 0.2, f" {s:.1f}", va="center", fontsize=7)
        ax.set_yticks(list(ys), names)
        ax.invert_yaxis()
        ax.set_xlabel("ms per stage (lower is better)")
        ax.set_title(_title(case, rows[0]), fontsize=10)
        ax.margins(x=0.18)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"Staging time against the copy ceiling and torch\n{_subtitle(payload)}", fontsize=9)
    _save(fig, out)


def draw_loop_lag(payload: dict[str, Any], out: Path) -> None:
    """Heartbeat lag over the last steady stage of each method, one panel per workload."""
    import matplotlib.pyplot as plt

    cases = _by_case(payload["results"])
    fig, axes = plt.subplots(1, len(cases), figsize=(5.2 * len(cases), 3.8), squeeze=False)
    for ax, (case, rows) in zip(axes[0], cases.items(), strict=True):
        top = 1.0
        for r in rows:
            if r["method"] not in ("astage", "torch DefaultStager", "torch Blocking"):
                continue
            series = r.get("lag_series") or []
            xs = [t * 1e3 for t, _ in series]
            ys = [lag for _, lag in series]
            ax.plot(
                xs, ys, marker="o", markersize=3, linewidth=1, color=COLORS[r["method"]], label=r["method"]
            )
            top = max([top, *ys])
        ax.axhline(1.0, color="#9e9e9e", linewidth=0.8, linestyle=":")
        ax.set_xlabel("ms since the stage began (1 ms heartbeat)")
        ax.set_ylabel("heartbeat lag, ms (lower is better)")
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(0, top * 4)  # room above the highest beat for the legend
        ax.set_title(_title(case, rows[0]), fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Event-loop lag during one steady stage (a blocked loop shows one late beat)\n{_subtitle(payload)}",
        fontsize=9,
    )
    _save(fig, out)


def draw_replication(payload: dict[str, Any], out: Path) -> None:
    """Median round time per method (slower rank), one panel per workload, log scale."""
    import matplotlib.pyplot as plt

    results = payload["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 3.8), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        names = sorted(result["runs_s"], key=lambda n: (n == "torch _ReplicationStager", n != "astage"))
        medians = [statistics.median(result["runs_s"][n]) * 1e3 for n in names]
        ys = range(len(names))
        ax.barh(list(ys), medians, color=[COLORS.get(n, "#444444") for n in names])
        for y, m in zip(ys, medians, strict=True):
            ax.text(m, y, f" {m:.1f}", va="center", fontsize=7)
        ax.set_yticks(list(ys), names)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms per round, 2 ranks (log scale, lower is better)")
        ax.set_title(_title(result["case"], result) + " a rank", fontsize=9)
        ax.set_xlim(min(medians) / 2, max(medians) * 4)  # room for the labels
    fig.suptitle(
        f"Replication against raw exchange, raw write+fsync and torch\n{_subtitle(payload)}", fontsize=9
    )
    _save(fig, out)


def _save(fig: Any, out: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out, format="svg", metadata={"Date": None})
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Draw every figure; the paths written are printed, one a line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.figures", description=__doc__.split("\n")[0])
    parser.add_argument("--staging", type=Path, default=RESULTS / "staging.json", help="bench_staging JSON")
    parser.add_argument(
        "--replication", type=Path, default=RESULTS / "replication.json", help="bench_replication JSON"
    )
    parser.add_argument("--out", type=Path, default=FIGURES, help=f"output folder (default {FIGURES})")
    args = parser.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        print("error: drawing the figures needs matplotlib: pip install 'astage[figures]'", file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "astage"  # stable ids: re-drawing changes no byte
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text (smaller, searchable)

    staging = json.loads(args.staging.read_text())
    replication = json.loads(args.replication.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for name, draw, payload in (
        ("staging.svg", draw_staging, staging),
        ("loop_lag.svg", draw_loop_lag, staging),
        ("replication.svg", draw_replication, replication),
    ):
        draw(payload, args.out / name)
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
