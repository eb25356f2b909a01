"""Nothing astage creates keeps a process from exiting, closed or not: real interpreters.

Each case runs a fresh ``python -c`` that uses an astage object, leaves it open, and
returns from its main code; the process must end with status 0.  The timeout only tells a
hang from an exit (every case ends in a few seconds, or never): it is no timing target.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import astage
import astage.dcp

ROOT = Path(__file__).resolve().parents[2]
HANG = 120  # seconds: far beyond any clean exit here


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that imports this tree's astage."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:  # subprocess.run killed it
        raise AssertionError(f"the interpreter did not exit within {HANG} s: it hangs\n{exc.stderr}") from exc


def assert_exits(code: str, *args: str) -> str:
    done = run_python(code, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout


# -- astage.dcp.StagerAdapter ----------------------------------------------------------------


def test_an_unclosed_adapter_after_a_stage_lets_the_process_exit() -> None:
    out = assert_exits(
        """
        import torch, astage, astage.dcp
        adapter = astage.dcp.StagerAdapter(astage.DefaultStager())
        staged = adapter.stage({"w": torch.arange(10.0), "n": 3}).result()
        assert torch.equal(staged["w"], torch.arange(10.0))
        print("staged")
        """
    )
    assert out.split() == ["staged"]


def test_an_adapter_of_a_callers_stager_left_open_lets_the_process_exit() -> None:
    assert_exits(
        """
        import torch, astage, astage.dcp
        stager = astage.DefaultStager(astage.StagingOptions(max_staging_bytes=1 << 20))
        adapter = astage.dcp.StagerAdapter(stager, close_stager=False)
        for _ in range(3):
            adapter.stage({"w": torch.randn(1000)}).result()
        """
    )


@pytest.mark.parametrize("wait", ["wait", "nowait"])
def test_an_unclosed_adapter_under_torch_async_save_lets_the_process_exit(tmp_path: Path, wait: str) -> None:
    # Without waiting, the exit still waits for torch's upload thread: the checkpoint is whole.
    assert_exits(
        """
        import sys, warnings, torch, astage, astage.dcp
        import torch.distributed.checkpoint as dcp
        warnings.simplefilter("ignore")
        adapter = astage.dcp.StagerAdapter()
        sd = {"w": torch.arange(64.0), "b": torch.ones(3, dtype=torch.int64)}
        response = dcp.async_save(sd, checkpoint_id=sys.argv[1], async_stager=adapter)
        if sys.argv[2] == "wait":
            response.upload_completion.result()
        """,
        str(tmp_path),
        wait,
    )
    target = {"w": torch.zeros(64), "b": torch.zeros(3, dtype=torch.int64)}
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.load(target, checkpoint_id=tmp_path)
    assert torch.equal(target["w"], torch.arange(64.0))
    assert torch.equal(target["b"], torch.ones(3, dtype=torch.int64))


def test_an_unclosed_adapter_with_a_stage_in_flight_lets_the_process_exit() -> None:
    assert_exits(
        """
        import torch, astage, astage.dcp
        adapter = astage.dcp.StagerAdapter()
        pending = [adapter.stage({"w": torch.ones(4 << 20)}) for _ in range(3)]
        """
    )


def test_an_adapter_dropped_without_close_stops_its_thread() -> None:
    before = set(threading.enumerate())
    adapter = astage.dcp.StagerAdapter()
    adapter.stage({"w": torch.arange(4.0)}).result()
    stager = adapter.stager
    del adapter
    gc.collect()
    # The adapter's loop thread (and any thread closing it) ends: join them (hang detector).
    for thread in set(threading.enumerate()) - before:
        # A thread listed while another thread's start() of it is under way cannot be
        # joined yet: wait until it has started (threading keeps no public event for it).
        assert thread._started.wait(HANG)  # type: ignore[attr-defined]
        thread.join(HANG)
        assert not thread.is_alive(), f"{thread.name} outlived its collected adapter"
    assert stager.closed  # the adapter owned it


# -- stagers on the caller's own loop --------------------------------------------------------


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_unclosed_stager_lets_the_process_exit(backend: str) -> None:
    assert_exits(
        """
        import sys, anyio, torch, astage
        async def main():
            stager = astage.DefaultStager()
            staged = await stager.stage({"w": torch.randn(1000), "n": 1})
            globals()["kept"] = (stager, staged)
        anyio.run(main, backend=sys.argv[1])
        """,
        backend,
    )


def test_an_unclosed_replication_stager_lets_both_ranks_exit(tmp_path: Path) -> None:
    code = """
        import sys, anyio, torch, torch.distributed as dist, astage
        rank, store, storage = int(sys.argv[1]), sys.argv[2], sys.argv[3]
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        async def main():
            rs = astage.ReplicationStager(storage_dir=f"{storage}/{rank}", timeout=60)
            result = await rs.replicate({"w": torch.full((100,), float(rank))}, step=1)
            assert torch.equal(result.replica["w"], torch.full((100,), float(1 - rank)))
            globals()["kept"] = (rs, result)
        anyio.run(main)
    """
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    store = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code), str(rank), str(store), str(tmp_path)],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=HANG)
            assert proc.returncode == 0, err
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_the_adapter_owns_no_non_daemon_thread() -> None:
    # What the exit would wait for: only a thread astage documents as delaying it may be one.
    before = set(threading.enumerate())
    with astage.dcp.StagerAdapter() as adapter:
        adapter.stage({"w": torch.arange(4.0)}).result()
        started = set(threading.enumerate()) - before
        assert started
        assert all(thread.daemon for thread in started)
