"""``Checkpointer.restore(on_read=...)``: the bytes of a restore, as they are read or received.

Real files and a real Checkpointer; the collective restore in a real gloo group.  Small
chunks (the loader's, the transport's) give many reports from a small state.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

import astage
import astage._checkpointer.local_restore
import astage._files.durable
from tests.distributed import holder_of, lose, node, run_group
from tests.helpers import no_blocking_calls_on_the_loop  # noqa: F401 - autouse fixture
from tests.replicators import DirectoryReplicator, FetchingReplicator, flip_last_byte
from tests.statedicts import assert_same_tree, model_state, same_state, state_of

STATE_NBYTES = 1 << 20
CHUNK = 64 << 10


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(astage._files.durable, "CHUNK_NBYTES", CHUNK)


def ramps(calls: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """The calls split into one run per copy read: each starts at (0, total)."""
    runs: list[list[tuple[int, int]]] = []
    for done, total in calls:
        if done == 0:
            runs.append([])
        assert runs, calls  # the first call is (0, total)
        runs[-1].append((done, total))
    return runs


def assert_ramp(run: list[tuple[int, int]], *, min_calls: int = 3) -> None:
    """Bytes only grow, under one total, and end at it."""
    total = run[0][1]
    assert total > STATE_NBYTES // 2, run
    assert all(t == total for _, t in run), run
    done = [d for d, _ in run]
    assert done == sorted(done), run
    assert done[-1] == total, run
    assert len(run) >= min_calls, run


@pytest.mark.anyio
async def test_a_local_restore_reports_its_bytes_up_to_the_total(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    async with astage.Checkpointer(tmp_path) as ckpt:
        await ckpt.save(2, model_state(2, STATE_NBYTES))
        await ckpt.wait()
        assert_same_tree(
            await ckpt.restore(on_read=lambda d, t: calls.append((d, t))), model_state(2, STATE_NBYTES)
        )
    (run,) = ramps(calls)
    assert_ramp(run, min_calls=STATE_NBYTES // CHUNK)
    assert (
        run[-1][1]
        == astage.inspect_checkpoint_file(
            tmp_path / "step_0000000002" / "rank00000.astage"
        ).header.body_nbytes
    )


@pytest.mark.anyio
@pytest.mark.parametrize("damage", ["missing", "tampered"])
async def test_a_restore_from_a_replica_reports_the_replica_read(tmp_path: Path, damage: str) -> None:
    peer, directory = tmp_path / "peer", tmp_path / "ckpt"
    calls: list[tuple[int, int]] = []
    async with astage.Checkpointer(
        directory, replication=DirectoryReplicator(peer), fallback_dirs=[peer]
    ) as ckpt:
        await ckpt.save(3, model_state(3, STATE_NBYTES))
        await ckpt.wait()
        own = directory / "step_0000000003" / "rank00000.astage"
        if damage == "missing":
            own.unlink()
        else:
            flip_last_byte(own)
        assert_same_tree(
            await ckpt.restore(3, on_read=lambda d, t: calls.append((d, t))), model_state(3, STATE_NBYTES)
        )
    runs = ramps(calls)
    # A tampered own file is refused once the storage with the bad byte is read (each is
    # verified as it lands: here the last one); the replica then starts again from 0.  A
    # missing one is never read.
    assert len(runs) == (1 if damage == "missing" else 2), [r[-1] for r in runs]
    for refused in runs[:-1]:
        done = [d for d, _ in refused]
        assert done == sorted(done), refused
        assert 0 < done[-1] <= refused[0][1], refused
    assert_ramp(runs[-1])


@pytest.mark.anyio
async def test_a_replica_from_fetch_replica_is_reported_too(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    calls: list[tuple[int, int]] = []
    async with astage.Checkpointer(
        directory, replication=FetchingReplicator(tmp_path / "peer"), rank=0
    ) as ckpt:
        await ckpt.save(5, model_state(5, STATE_NBYTES))
        await ckpt.wait()
        (directory / "step_0000000005" / "rank00000.astage").write_bytes(b"")
        await ckpt.restore(on_read=lambda d, t: calls.append((d, t)))
    (run,) = ramps(calls)
    assert_ramp(run)


@pytest.mark.anyio
@pytest.mark.parametrize("bad", [3, "progress", [print]])
async def test_an_on_read_that_is_not_callable_is_a_configuration_error(tmp_path: Path, bad: Any) -> None:
    async with astage.Checkpointer(tmp_path) as ckpt:
        await ckpt.save(1, model_state(1))
        await ckpt.wait()
        with pytest.raises(astage.ConfigurationError, match="on_read must be callable"):
            await ckpt.restore(on_read=bad)
        assert_same_tree(await ckpt.restore(on_read=None), model_state(1))  # still usable


@pytest.mark.anyio
async def test_a_failing_on_read_is_logged_and_the_restore_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[int] = []

    def broken(done: int, total: int) -> None:
        seen.append(done)
        raise RuntimeError(f"bar broke at {done} of {total}")

    async with astage.Checkpointer(tmp_path) as ckpt:
        await ckpt.save(1, model_state(1, STATE_NBYTES))
        await ckpt.wait()
        with caplog.at_level(logging.ERROR, logger="astage.checkpointer"):
            assert_same_tree(await ckpt.restore(on_read=broken), model_state(1, STATE_NBYTES))
    assert len(seen) > 2  # called on for every chunk all the same
    assert "bar broke at 0 of" in caplog.text
    assert "the on_read callback failed" in caplog.text


@pytest.mark.anyio
async def test_a_long_restore_logs_its_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with astage.Checkpointer(tmp_path) as ckpt:
        await ckpt.save(4, model_state(4, STATE_NBYTES))
        await ckpt.wait()
        # "Long" is over a second; rather than wait one, every report is due at once.
        monkeypatch.setattr(astage._checkpointer.local_restore, "_LOG_EVERY", 0.0)
        with caplog.at_level(logging.INFO, logger="astage.checkpointer"):
            await ckpt.restore()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("restoring step 4: ")]
    assert lines[0] == "restoring step 4: 0.0 of 1.0 MB", lines
    assert lines[-1] == "restoring step 4: 1.0 of 1.0 MB", lines
    assert len(lines) > 2


# -- the collective restore, in a gloo group -----------------------------------------------


async def collective_target(rank: int, world: int, root: str, lost: int) -> dict[str, Any]:
    def job() -> tuple[astage.ReplicationStager, astage.Checkpointer]:
        rs = astage.ReplicationStager(
            storage_dir=node(root, rank) / "replicas", timeout=30, chunk_bytes=4 << 10
        )
        return rs, astage.Checkpointer(node(root, rank) / "ckpt", rank=rank, replication=rs)

    size = STATE_NBYTES // 4 - 4  # float32s, a multiple of 10
    rs, ckpt = job()
    async with rs, ckpt:
        await ckpt.save(1, state_of(rank, 1, size))
        await ckpt.wait()
    await lose(root, rank, lost)
    calls: list[tuple[int, int]] = []
    rs, ckpt = job()
    async with rs, ckpt:
        state = await ckpt.restore(on_read=lambda d, t: calls.append((d, t)))
    return {"calls": calls, "same": same_state(state, state_of(rank, 1, size))}


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_collective_restore_reports_the_bytes_read_or_received(tmp_path: Path, backend: str) -> None:
    results = [
        r.unwrap() for r in run_group(2, collective_target, str(tmp_path), 1, timeout=60, backend=backend)
    ]
    assert holder_of(1, 2) == 0
    for rank, value in enumerate(results):
        assert value["same"], rank
        (run,) = ramps(value["calls"])
        # Rank 0 reads its own file in the loader's 16 MiB chunks (the small-chunk fixture
        # does not reach the group's processes): one; rank 1 receives its copy from rank 0
        # in the transport's 4 KiB chunks.
        assert_ramp(run, min_calls=2 if rank == 0 else STATE_NBYTES // (4 << 10))


# -- the snippet in docs/logging.md --------------------------------------------------------


def logging_guide_snippet() -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "logging.md").read_text()
    section = text[text.index("## Progress of a restore") :]
    return section[section.index("```python\n") + len("```python\n") : section.index("\n```\n")]


@pytest.mark.anyio
async def test_the_guide_s_progress_bar_snippet_restores(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(logging_guide_snippet(), "docs/logging.md", "exec"), namespace)
    async with astage.Checkpointer(tmp_path) as ckpt:
        await ckpt.save(1, model_state(1, STATE_NBYTES))
        await ckpt.wait()
        with caplog.at_level(logging.ERROR, logger="astage.checkpointer"):
            assert_same_tree(await namespace["restore_with_a_bar"](ckpt), model_state(1, STATE_NBYTES))
    assert "on_read callback failed" not in caplog.text  # the bar's updates worked
