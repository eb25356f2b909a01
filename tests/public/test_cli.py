"""The ``astage`` command on real checkpoint directories made by a real Checkpointer.

Most checks run the command as a subprocess (``python -m astage``) and parse its JSON; the
variations of one behaviour run in-process through :func:`astage.cli.main`, the same code.
``astage bench`` is also run from a normal (non-editable) install of the package.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import astage
from astage._files.durable import write_checkpoint_file
from astage._files.markers import read_marker
from astage._format.codec import encode
from astage.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]

# Text that rich would read as markup, an emoji code and a terminal escape: from a file, all
# of it is data and must be shown as itself.
HOSTILE_KEY = "x[/]"
HOSTILE_ID = "run[/]7"
HOSTILE_VALUE = "[bold red]boom[/] :smile: \x1b[2J"


def astage_cli(
    *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m astage ARGS`` in a fresh process; stdout is a pipe, as in a script."""
    return subprocess.run(
        [sys.executable, "-m", "astage", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def state(step: int) -> dict[str, Any]:
    return {
        HOSTILE_KEY: torch.arange(6, dtype=torch.float32) + step,
        "model": {"w": torch.ones(2, 3) * step, "b": torch.zeros(3, dtype=torch.float64)},
        "meta": {"step": step, "lr": 0.5, "note": HOSTILE_VALUE, "pair": (1, "two")},
    }


async def _make_tree(root: Path) -> None:
    # Two ranks share one checkpoint directory; retention keeps steps 2, 3, 4.
    for rank in (0, 1):
        async with astage.Checkpointer(root / "run-a", rank=rank, keep=3) as ckpt:
            for step in (1, 2, 3, 4):
                await ckpt.save(step, state(step))
    async with astage.Checkpointer(root / "nested" / "run-b", keep=None) as ckpt:
        await ckpt.save(10, state(10))
    await write_checkpoint_file(
        root / "replicas" / "replica-owner00001-holder00000.astage",
        encode(state(7), owner_rank=1, holder_rank=0, step=7, checkpoint_id=HOSTILE_ID),
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    anyio.run(_make_tree, root)
    return root


@pytest.fixture
def tree(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the pristine tree, free to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "tree"))


def step_file(tree: Path, step: int, rank: int, suffix: str = "astage") -> Path:
    return tree / "run-a" / f"step_{step:010d}" / f"rank{rank:05d}.{suffix}"


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def checkpoints_by_name(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {Path(c["directory"]).name: c for c in doc["checkpoints"]}


# -- ls -------------------------------------------------------------------------------------


def test_ls_json_lists_steps_ranks_latest_and_replicas_recursively(tree: Path) -> None:
    done = astage_cli("ls", "--json", str(tree))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["ok"] is True
    assert doc["problems"] == []
    runs = checkpoints_by_name(doc)
    assert set(runs) == {"run-a", "run-b"}
    run_a = runs["run-a"]
    assert run_a["latest"] == 4
    assert run_a["ranks"] == [0, 1]
    assert [s["step"] for s in run_a["steps"]] == [2, 3, 4]
    for s in run_a["steps"]:
        assert s["committed"] is True
        assert s["damaged"] is False
        on_disk = sum(p.stat().st_size for p in Path(s["path"]).iterdir())
        assert s["nbytes"] == on_disk
        assert [r["rank"] for r in s["ranks"]] == [0, 1]
        for r in s["ranks"]:
            assert r["checkpoint_file"] == f"rank{r['rank']:05d}.astage"
            assert r["marker_file"] == f"rank{r['rank']:05d}.COMMITTED"
            assert r["committed"] is True
            assert r["problem"] is None
    assert runs["run-b"]["latest"] == 10
    [replicas] = doc["replicas"]
    [replica] = replicas["files"]
    assert replica["name"] == "replica-owner00001-holder00000.astage"
    assert (replica["owner_rank"], replica["holder_rank"], replica["step"]) == (1, 0, 7)
    assert replica["checkpoint_id"] == HOSTILE_ID


def test_ls_of_a_step_directory_shows_that_step(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = in_process(["ls", "--json", str(step_file(tree, 3, 0).parent)], capsys)
    assert code == 0, err
    [run] = json.loads(out)["checkpoints"]
    assert [s["step"] for s in run["steps"]] == [3]


def test_ls_tables_show_untrusted_text_as_itself_and_are_not_cut_when_piped(tmp_path: Path) -> None:
    # A long directory name: an 80-column table would have to cut or fold it.
    deep = tmp_path / ("d" * 120) / "run[/]x"
    anyio.run(_make_tree, deep)
    done = astage_cli("ls", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert str(deep / "run-a") in done.stdout
    assert repr(HOSTILE_ID) in done.stdout
    assert "replica-owner00001-holder00000.astage" in done.stdout
    assert "…" not in done.stdout
    assert "latest" in done.stdout
    assert "\x1b" not in done.stdout  # piped: no colours, and no escape from a file


def test_ls_on_a_terminal_draws_progress_and_colours_without_reading_markup(tree: Path) -> None:
    done = astage_cli("ls", str(tree), env={"FORCE_COLOR": "1"})
    assert done.returncode == 0, done.stderr
    assert repr(HOSTILE_ID) in done.stdout
    assert "checking committed steps and replicas" in done.stderr  # the progress bar, on stderr


def test_ls_flags_every_damaged_committed_step_and_exits_non_zero(tree: Path) -> None:
    step_file(tree, 2, 1).unlink()  # missing data file
    flip_last_byte(step_file(tree, 3, 0))  # a flipped bit in the data
    done = astage_cli("ls", "--json", str(tree))
    assert done.returncode == 1, done.stderr
    doc = json.loads(done.stdout)
    assert doc["ok"] is False
    steps = {s["step"]: s for s in checkpoints_by_name(doc)["run-a"]["steps"]}
    assert (steps[2]["committed"], steps[2]["damaged"]) == (True, True)
    assert "missing" in steps[2]["problems"][0]
    assert "rank 1" in steps[2]["problems"][0]
    assert (steps[3]["committed"], steps[3]["damaged"]) == (True, True)
    assert "checksum" in steps[3]["problems"][0]
    assert (steps[4]["committed"], steps[4]["damaged"]) == (True, False)
    assert len(doc["problems"]) == 2
    assert checkpoints_by_name(doc)["run-a"]["latest"] == 4


def test_ls_tables_name_the_damage_on_stderr(tree: Path) -> None:
    step_file(tree, 4, 1).unlink()
    done = astage_cli("ls", str(tree))
    assert done.returncode == 1
    assert "DAMAGED" in done.stdout
    assert "step_0000000004: rank 1: its checkpoint file is missing" in done.stderr


def truncate(path: Path) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - 1)


def garble(path: Path) -> None:
    path.write_bytes(b"{not json")


def wrong_rank(path: Path) -> None:
    # A valid marker of another rank: it vouches for nothing here.
    path.write_bytes(path.with_name("rank00000.COMMITTED").read_bytes())


def swap_data(path: Path) -> None:
    # A valid checkpoint file, but of another step: the marker's checksums do not match.
    shutil.copyfile(step_file(path.parents[1].parent, 2, 1), path)


@pytest.mark.parametrize(
    ("suffix", "damage", "needs_verify"),
    [
        ("astage", Path.unlink, False),
        ("astage", truncate, False),
        ("astage", swap_data, False),
        ("astage", flip_last_byte, True),
        ("COMMITTED", garble, False),
        ("COMMITTED", wrong_rank, False),
    ],
)
@pytest.mark.parametrize("verify", [True, False])
def test_ls_exit_status_follows_what_restore_would_refuse(
    tree: Path,
    capsys: pytest.CaptureFixture[str],
    suffix: str,
    damage: Any,
    needs_verify: bool,
    verify: bool,
) -> None:
    damage(step_file(tree, 4, 1, suffix))
    code, out, _ = in_process(["ls", "--json", *([] if verify else ["--no-verify"]), str(tree)], capsys)
    doc = json.loads(out)
    [step4] = [s for s in checkpoints_by_name(doc)["run-a"]["steps"] if s["step"] == 4]
    if verify or not needs_verify:
        assert code == 1
        assert step4["damaged"] is True
        assert checkpoints_by_name(doc)["run-a"]["latest"] == 3
    else:  # --no-verify reads headers only, as documented
        assert code == 0


def test_an_uncommitted_step_is_listed_but_is_not_damage(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What a crash between the data file and its marker leaves.
    crashed = tree / "run-a" / "step_0000000005"
    crashed.mkdir()
    shutil.copyfile(step_file(tree, 4, 0), crashed / "rank00000.astage")
    code, out, err = in_process(["ls", "--json", str(tree)], capsys)
    assert code == 0, err
    run_a = checkpoints_by_name(json.loads(out))["run-a"]
    [step5] = [s for s in run_a["steps"] if s["step"] == 5]
    assert (step5["committed"], step5["damaged"]) == (False, False)
    assert step5["problems"] == []
    assert step5["ranks"][0]["checkpoint_file"] == "rank00000.astage"
    assert run_a["latest"] == 4


def test_a_damaged_replica_is_flagged(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    replica = tree / "replicas" / "replica-owner00001-holder00000.astage"
    flip_last_byte(replica)
    code, out, _ = in_process(["ls", "--json", "--no-verify", str(tree)], capsys)
    assert code == 0  # only the header is read without verification
    code, out, _ = in_process(["ls", "--json", str(tree)], capsys)
    assert code == 1
    [replicas] = json.loads(out)["replicas"]
    assert "checksum" in replicas["files"][0]["problem"]
    replica.write_bytes(b"garbage")
    code, out, _ = in_process(["ls", "--json", "--no-verify", str(tree)], capsys)
    assert code == 1
    [replicas] = json.loads(out)["replicas"]
    assert replicas["files"][0]["problem"]


def test_ls_of_a_missing_directory_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = in_process(["ls", str(tmp_path / "nope")], capsys)
    assert code == 2
    assert "is not a directory" in err


# -- inspect --------------------------------------------------------------------------------


def test_inspect_json_shows_every_leaf_and_whether_the_file_is_committed(tree: Path) -> None:
    done = astage_cli("inspect", "--json", str(step_file(tree, 4, 1)))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert (doc["kind"], doc["step"], doc["owner_rank"], doc["committed"], doc["verified"]) == (
        "checkpoint", 4, 1, True, True,
    )  # fmt: skip
    leaves = {leaf["key_path"]: leaf for leaf in doc["leaves"]}
    assert leaves[repr([HOSTILE_KEY])]["shape"] == [6]
    assert leaves["['model']['b']"] | {"storage": 0} == {
        "key_path": "['model']['b']", "type": "tensor", "dtype": "float64", "shape": [3], "storage": 0,
        "nbytes": 24,
    }  # fmt: skip
    assert leaves["['meta']['step']"] == {"key_path": "['meta']['step']", "type": "int", "value": "4"}
    assert leaves["['meta']['note']"]["value"] == repr(HOSTILE_VALUE)
    assert leaves["['meta']['pair'][1]"]["value"] == "'two'"


def test_inspect_tables_show_untrusted_text_as_itself(tree: Path) -> None:
    replica = tree / "replicas" / "replica-owner00001-holder00000.astage"
    done = astage_cli("inspect", str(replica))
    assert done.returncode == 0, done.stderr
    assert "replica of rank 1's step 7, kept by rank 0" in done.stdout
    assert repr(HOSTILE_ID) in done.stdout
    assert repr([HOSTILE_KEY]) in done.stdout
    assert repr(HOSTILE_VALUE).replace("\x1b", "\\x1b") in done.stdout
    assert "\x1b" not in done.stdout
    assert "checksums verified" in done.stdout


def test_inspect_draws_its_verification_progress_on_a_terminal_only(
    tree: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(step_file(tree, 4, 0))
    code, _, err = in_process(["inspect", path], capsys)
    assert (code, "verifying" in err) == (0, False)
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich treats stderr as a terminal
    code, out, err = in_process(["inspect", path], capsys)
    assert (code, "verifying rank00000.astage" in err) == (0, True)
    assert "checksums verified" in out


def test_inspect_recognises_a_commit_marker(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = step_file(tree, 3, 0, "COMMITTED")
    done = astage_cli("inspect", str(marker))
    assert done.returncode == 0, done.stderr
    assert "commit marker: step 3 of rank 0 is committed" in done.stdout
    assert "rank00000.astage" in done.stdout
    code, out, _ = in_process(["inspect", "--json", str(marker)], capsys)
    doc = json.loads(out)
    assert (code, doc["kind"], doc["step"], doc["rank"], doc["problem"]) == (0, "marker", 3, 0, None)
    assert doc["files"][0]["name"] == "rank00000.astage"
    flip_last_byte(step_file(tree, 3, 0))
    code, out, _ = in_process(["inspect", "--json", str(marker)], capsys)
    assert code == 1
    assert "checksum" in json.loads(out)["problem"]


def test_inspect_of_an_uncommitted_checkpoint_file_says_so(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = step_file(tree, 4, 0, "COMMITTED")
    marker.write_bytes(b"{}")  # invalid: the Checkpointer ignores it
    code, out, err = in_process(["inspect", str(step_file(tree, 4, 0))], capsys)
    assert code == 0, err
    assert "step 4: not committed" in out
    marker.unlink()
    code, out, err = in_process(["inspect", "--json", "--no-verify", str(step_file(tree, 4, 0))], capsys)
    assert (code, json.loads(out)["committed"]) == (0, False)


def test_a_file_without_a_holder_outside_a_checkpointer_is_a_checkpoint_file_not_a_replica(
    tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A copied-out local file keeps the format but has no holder: calling it a replica (a
    # peer's copy) would send an operator looking for the wrong rank's disk.
    loose = tree / "copied" / "rank00000.astage"
    loose.parent.mkdir()
    shutil.copy(step_file(tree, 4, 0), loose)
    code, out, err = in_process(["inspect", "--json", "--no-verify", str(loose)], capsys)
    doc = json.loads(out)
    assert (code, doc["kind"], doc["holder_rank"], "committed" in doc) == (0, "checkpoint", None, False)
    code, out, err = in_process(["inspect", "--no-verify", str(loose)], capsys)
    assert code == 0, err
    assert "checkpoint file of rank 0, step 4 (outside a Checkpointer's step directory" in out
    assert "replica" not in out
    code, out, err = in_process(["ls", str(loose.parent)], capsys)
    assert code == 0, err
    assert "replicas and other checkpoint files in" in out
    assert "None" not in out


def test_an_error_naming_untrusted_text_is_one_plain_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bad[").mkdir()
    path = tmp_path / "bad[/]\nname.astage"  # a directory "bad[" and a file "]\nname.astage"
    path.write_bytes(b"not a replica")
    code, _, err = in_process(["inspect", str(path)], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert "bad[/]\\nname.astage" in err


# -- any valid file is shown ------------------------------------------------------------------

# Every finite timestamp is valid to the loaders: beyond the platform's time_t (1e300,
# -1e20), beyond its calendar (1e18, 1e17), before year 1 (-6e10), and ordinary ones.
ODD_TIMES = [1e300, -1e20, 1e18, 1e17, -1e17, -6e10, 0.0, 5e-324]


async def _save_with_created(root: Path, created: float) -> tuple[Path, Path]:
    """A committed step whose marker says ``created``, and a loose file created then."""
    async with astage.Checkpointer(root / "run") as ckpt:
        await ckpt.save(1, state(1))
    marker_path = root / "run" / "step_0000000001" / "rank00000.COMMITTED"
    marker = read_marker(marker_path, step=1, rank=0)
    marker_path.write_bytes(dataclasses.replace(marker, created=created).to_json())
    loose = root / "loose" / "rank00000.astage"
    loose.parent.mkdir()
    await write_checkpoint_file(
        loose, encode(state(2), owner_rank=0, step=2, checkpoint_id="c", created=created)
    )
    return marker_path, loose


@pytest.mark.parametrize("created", ODD_TIMES)
def test_a_valid_file_with_any_creation_time_is_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], created: float
) -> None:
    marker, loose = anyio.run(_save_with_created, tmp_path, created)
    assert astage.inspect_checkpoint_file(loose).created == created  # the loaders accept it
    assert read_marker(marker, step=1, rank=0).created == created
    for argv in (["inspect", str(loose)], ["inspect", str(marker)], ["ls", str(tmp_path)]):
        code, out, err = in_process(argv, capsys)
        assert (code, err) == (0, ""), argv
        assert "DAMAGED" not in out
        code, out, err = in_process([argv[0], "--json", *argv[1:]], capsys)
        assert (code, err) == (0, ""), argv
        doc = json.loads(out)
        if argv[0] == "inspect":
            assert doc["created"] == created
        else:
            assert doc["ok"]
            assert doc["checkpoints"][0]["steps"][0]["ranks"][0]["created"] == created
    code, out, _ = in_process(["inspect", str(loose)], capsys)
    if abs(created) < 1e11:  # within the calendar: a local date and time, year padded
        expected = time.localtime(created)
        assert f"created {expected.tm_year:04d}-{expected.tm_mon:02d}-{expected.tm_mday:02d}" in out
    elif abs(created) > 1e17:
        assert f"created {created:.6g} s from the epoch" in out


def test_only_a_damaged_file_is_reported_damaged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, loose = anyio.run(_save_with_created, tmp_path, 1e300)
    flip_last_byte(loose)
    code, _, err = in_process(["inspect", str(loose)], capsys)
    assert code == 2
    assert "checksum" in err


# -- the parser -----------------------------------------------------------------------------


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_argument_has_help_text() -> None:
    for parser in _parsers(build_parser()):
        assert parser.description, parser.prog
        for action in parser._actions:
            assert action.help, (parser.prog, action.dest)
            assert action.help != argparse.SUPPRESS, (parser.prog, action.dest)


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_describes_the_tool_and_version_is_printed(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([flag])
    out = capsys.readouterr().out
    assert exited.value.code == 0
    if flag == "--version":
        assert out.strip() == f"astage {astage.__version__}"
    else:
        assert "Look at and verify astage checkpoints" in out
        assert astage.__doc__ is not None
        assert astage.__doc__.splitlines()[0] not in out


# -- bench, from a normal install -------------------------------------------------------------


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``pip install --no-deps .`` into a directory; the environment that runs from it.

    psutil is blocked (a package that fails to import comes first on the path) and the
    checkout is not on the path: what runs must come from the install and its dependencies.
    """
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is needed to build the package without network access")
    base = tmp_path_factory.mktemp("installed")
    target, blocker = base / "site", base / "blocker" / "psutil"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('psutil is not a dependency of astage')\n")
    skip = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__")
    source = Path(shutil.copytree(ROOT, base / "src", ignore=skip))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip, "--target", str(target), "."], cwd=source, check=True, capture_output=True, timeout=300
    )
    shutil.rmtree(source)
    return {"PYTHONPATH": f"{blocker.parent}{os.pathsep}{target}", "PYTHONSAFEPATH": "1"}


def test_the_install_ships_the_benchmarks_and_a_typo_lists_them(
    installed: dict[str, str], tmp_path: Path
) -> None:
    done = astage_cli("bench", "stagign", cwd=tmp_path, env=installed)
    assert done.returncode == 2
    shipped = sorted(path.stem.removeprefix("bench_") for path in (ROOT / "benchmarks").glob("bench_*.py"))
    listed = "the benchmarks are: " + ", ".join(shipped)
    assert f"no benchmark named 'stagign'; {listed}" in done.stderr


@pytest.mark.parametrize("terminal", [False, True])
def test_bench_runs_every_benchmark_after_a_failure_and_exits_non_zero(
    installed: dict[str, str], tmp_path: Path, terminal: bool
) -> None:
    bench_dir = Path(installed["PYTHONPATH"].split(os.pathsep)[1]) / "astage" / "_bench"
    (bench_dir / "bench_aaa_fails.py").write_text("import sys\nprint('aaa ran')\nsys.exit(3)\n")
    (bench_dir / "bench_zzz_works.py").write_text("print('zzz ran')\n")
    try:
        env = installed | ({"FORCE_COLOR": "1"} if terminal else {})  # rich: act as on a terminal
        done = astage_cli("bench", "aaa_fails", "zzz_works", cwd=tmp_path, env=env)
    finally:
        (bench_dir / "bench_aaa_fails.py").unlink()
        (bench_dir / "bench_zzz_works.py").unlink()
    assert done.returncode == 1
    assert "aaa ran" in done.stdout
    assert "zzz ran" in done.stdout  # not skipped after the failure
    assert "1 of 2 failed: aaa_fails (exit status 3)" in done.stderr


@pytest.mark.slow
def test_bench_quick_runs_benchmarks_from_a_normal_install(installed: dict[str, str], tmp_path: Path) -> None:
    # From the installed package (astage._bench), the ones that spawn ranks or fresh
    # processes by module name; each benchmark's quick run in a checkout is in
    # tests/public/test_benchmarks_smoke.py.
    done = astage_cli(
        "bench", "--quick", "replication", "restore", "staging", cwd=tmp_path, env=installed, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("replication", "restore", "staging"):
        assert f"astage bench: running {name} (quick)" in done.stderr
    assert "torch _ReplicationStager" in done.stdout
    assert "ceiling (copy_)" in done.stdout
