"""astage stagers under torch.distributed.checkpoint: real DCP, real files, 1 and 2 processes."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.staging import AsyncStager as TorchAsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

import astage.dcp
from astage import (
    ClosedError,
    ConfigurationError,
    DefaultStager,
    PersistError,
    StagingOptions,
    UnsupportedInputError,
)
from astage.dcp import StagerAdapter
from tests.distributed import run_group
from tests.helpers import heartbeat_gaps
from tests.statedicts import ALL_DTYPES, assert_same_tree, random_tensor, tensors_of

ROOT = Path(__file__).resolve().parents[2]
NO_GROUP_WARNING = "ignore:torch.distributed is disabled:UserWarning"


# -- state_dicts ------------------------------------------------------------------------


def training_state(seed: int = 0, *, scale: int = 1) -> dict[str, Any]:
    """A model and an Adam-like optimizer state, many dtypes, and plain values."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(64 * scale, 32, generator=gen)
    return {
        "model": {
            "layer.weight": weight,
            "layer.bias": torch.randn(64 * scale, generator=gen),
            "embedding": torch.randn(100, 16, generator=gen).to(torch.bfloat16),
            "buffers": {str(dtype): random_tensor((5, 3), dtype, gen) for dtype in ALL_DTYPES},
        },
        "optim": {
            "state": {
                0: {
                    "step": torch.tensor(7.0),
                    "exp_avg": torch.randn_like(weight),
                    "exp_avg_sq": weight.square(),
                },
                1: {"step": torch.tensor(7.0), "exp_avg": torch.randn(64 * scale, generator=gen)},
            },
            "param_groups": [{"lr": 1e-3, "weight_decay": 0.01, "params": [0, 1], "name": "all"}],
        },
        "progress": {"step": 7, "tokens": 123456},
    }


def blank_like(tree: Any) -> Any:
    """The same tree with zeroed tensors and plain values replaced: what a fresh trainer holds."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {key: blank_like(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [blank_like(value) for value in tree]
    return None


def snapshot(tree: Any) -> Any:
    """A deep copy that later changes to ``tree`` cannot reach."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {key: snapshot(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [snapshot(value) for value in tree]
    return tree


def mutate(tree: Any) -> None:
    """Overwrite every tensor in place, as the next training steps would."""
    if isinstance(tree, torch.Tensor):
        if tree.numel():
            tree.view(-1).view(torch.uint8).bitwise_not_()
    elif isinstance(tree, dict):
        for value in tree.values():
            mutate(value)


def load(path: Path, like: dict[str, Any]) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into a fresh tree shaped like ``like``."""
    target = blank_like(like)
    dcp.load(target, checkpoint_id=path)
    return target


class GatedPlanner(DefaultSavePlanner):
    """DCP's default planner that holds the upload until ``gate`` is set (a real planner)."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__()
        self.gate = gate

    def create_local_plan(self) -> SavePlan:
        assert self.gate.wait(30), "the test never opened the gate"
        return super().create_local_plan()


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    """Opened at teardown whatever happens, so no upload thread outlives a failed test."""
    event = threading.Event()
    yield event
    event.set()


# -- StagerAdapter under dcp.async_save ----------------------------------------------------


def save_through_adapter(
    adapter: StagerAdapter, sd: dict[str, Any], path: Path, **kwargs: Any
) -> AsyncSaveResponse:
    response = dcp.async_save(sd, checkpoint_id=path, async_stager=adapter, **kwargs)
    assert isinstance(response, AsyncSaveResponse)  # stage() returned a future
    return response


@pytest.mark.filterwarnings(NO_GROUP_WARNING)
def test_adapter_round_trip_in_a_single_process_without_a_group(tmp_path: Path) -> None:
    sd = training_state()
    stager = DefaultStager()
    with StagerAdapter(stager) as adapter:
        assert isinstance(adapter, TorchAsyncStager)
        save_through_adapter(adapter, sd, tmp_path).upload_completion.result(timeout=30)
    assert stager.closed
    assert_same_tree(load(tmp_path, sd), sd)


def test_adapter_round_trip_in_a_one_rank_gloo_group(one_rank_group: None, tmp_path: Path) -> None:
    sd = training_state()
    with StagerAdapter() as adapter:
        response = save_through_adapter(adapter, sd, tmp_path)
        response.staging_completion.result(timeout=30)
        response.upload_completion.result(timeout=30)
    assert_same_tree(load(tmp_path, sd), sd)


def test_adapter_copy_is_isolated_from_mutations_after_staging(
    one_rank_group: None, tmp_path: Path, gate: threading.Event
) -> None:
    sd = training_state()
    expected = snapshot(sd)
    with StagerAdapter() as adapter:
        response = save_through_adapter(adapter, sd, tmp_path, planner=GatedPlanner(gate))
        response.staging_completion.result(timeout=30)
        mutate(sd)  # the upload has not read a byte yet: the gate is closed
        gate.set()
        response.upload_completion.result(timeout=30)
    assert_same_tree(load(tmp_path, sd), expected)


def test_adapter_staged_copies_are_reclaimed_after_dcp_wrote_them(
    one_rank_group: None, tmp_path: Path
) -> None:
    sd = training_state()
    # Room for one copy exactly: the second save waits until DCP has dropped the first copy,
    # which DCP's upload thread does just after it completes upload_completion.  (With more
    # room, a few small buffers DCP still held then were allocated anew instead.)
    nbytes = sum(t.untyped_storage().nbytes() for t in tensors_of(sd))
    stager = DefaultStager(StagingOptions(max_staging_bytes=nbytes))
    with StagerAdapter(stager) as adapter:
        save_through_adapter(adapter, sd, tmp_path / "a").upload_completion.result(timeout=30)
        first = stager.last_stats
        save_through_adapter(adapter, sd, tmp_path / "b").upload_completion.result(timeout=30)
        second = stager.last_stats
    assert first is not None
    assert second is not None
    assert first.bytes_allocated > 0
    assert second.bytes_allocated == 0  # every buffer of the first save came back
    assert second.reused_buffers == second.storages


def test_adapter_staging_errors_reach_dcp_unchanged(one_rank_group: None, tmp_path: Path) -> None:
    # torch 2.13 reports staging_completion as done when the staging future had already
    # failed by the time async_save looked; upload_completion always carries the error.
    with StagerAdapter() as adapter:
        response = save_through_adapter(adapter, {"bad": torch.empty(3, device="meta")}, tmp_path)
        with pytest.raises(UnsupportedInputError, match=r"state_dict\['bad'\]: meta tensors"):
            response.upload_completion.result(timeout=30)
    assert not (tmp_path / ".metadata").exists()


def test_adapter_lifecycle() -> None:
    threads = set(threading.enumerate())
    stager = DefaultStager()
    adapter = StagerAdapter(stager, close_stager=False)
    staged = adapter.stage({"w": torch.arange(4.0)})
    adapter.synchronize_staging()
    assert torch.equal(staged.result()["w"], torch.arange(4.0))
    assert adapter.should_synchronize_after_execute
    adapter.close()
    adapter.close()
    assert adapter.closed
    deadline = time.monotonic() + 5  # anyio's idle worker threads exit just after their loop
    while not set(threading.enumerate()) <= threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(threading.enumerate()) <= threads  # the event loop thread is gone
    assert not stager.closed  # the caller keeps it
    with pytest.raises(ClosedError):
        adapter.stage({"w": torch.zeros(1)})
    unused = DefaultStager()
    StagerAdapter(unused).close()  # never started: still closes the stager it owns
    assert unused.closed


@pytest.mark.parametrize(
    ("state_dict", "match"),
    [([torch.zeros(1)], "DCP saves a dict"), ({1: torch.zeros(1)}, r"state_dict\[1\]: DCP needs str")],
)
def test_adapter_rejects_what_dcp_cannot_save(state_dict: Any, match: str) -> None:
    with StagerAdapter() as adapter, pytest.raises(UnsupportedInputError, match=match):
        adapter.stage(state_dict)


def test_adapter_needs_an_astage_stager() -> None:
    with pytest.raises(ConfigurationError, match="astage stager"):
        StagerAdapter(object())  # type: ignore[arg-type]


@pytest.mark.gpu
def test_adapter_stages_on_the_callers_stream(one_rank_group: None, tmp_path: Path) -> None:
    stream = torch.cuda.Stream()
    with StagerAdapter() as adapter, torch.cuda.stream(stream):
        big = torch.zeros(32 << 20, device="cuda")
        big.add_(1)  # pending on `stream` when stage() is called
        response = save_through_adapter(adapter, {"big": big}, tmp_path)
        response.upload_completion.result(timeout=60)
    assert bool(load(tmp_path, {"big": big.cpu()})["big"].eq(1).all())


# -- astage.dcp.async_save -------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_save_stages_then_uploads(
    one_rank_group: None, tmp_path: Path, gate: threading.Event
) -> None:
    sd = training_state()
    expected = snapshot(sd)
    handle = await astage.dcp.async_save(sd, checkpoint_id=tmp_path, planner=GatedPlanner(gate))
    assert not handle.done()  # staged: the upload waits at the gate
    assert handle.staging_seconds > 0
    mutate(sd)
    gate.set()
    metadata = await handle.wait()
    assert handle.done()
    assert "model.layer.weight" in metadata.state_dict_metadata
    assert_same_tree(load(tmp_path, sd), expected)


@pytest.mark.anyio
async def test_async_save_keeps_the_loop_ticking_during_the_upload(
    one_rank_group: None, tmp_path: Path
) -> None:
    sd = training_state(scale=4096)  # ~100 MB on disk
    async with DefaultStager() as stager:
        handle = await astage.dcp.async_save(sd, checkpoint_id=tmp_path, stager=stager)
        beats = await heartbeat_gaps(handle.wait, period=0.002)
    gaps, upload_seconds = beats.gaps, beats.elapsed
    # A loop blocked by the upload would see one beat and one gap as long as the upload.
    assert len(gaps) >= 10, (len(gaps), upload_seconds)
    assert max(gaps) < upload_seconds / 2, (max(gaps), upload_seconds)
    # ... and would spend most of that time on its own thread's CPU, however loaded the
    # machine. The upload runs in a thread of its own, so the loop only polls: its beats
    # cost 0.2-2 ms of CPU. About one run in twenty shows one or two beats of 15-50 ms,
    # all user time, while DCP's writer thread runs torch.save and collects its garbage;
    # none of it is astage's code on the loop. So: no beat holds a quarter of the upload
    # (the upload's work done on the loop in one go), and no more than three beats hold
    # over 10 ms (the upload's work done on the loop a slice at a time).
    heavy = [busy for busy in beats.busy if busy > 0.01]
    assert max(beats.busy) < upload_seconds / 4, (max(beats.busy), upload_seconds)
    assert len(heavy) <= 3, (heavy, upload_seconds)
    loaded = load(tmp_path, sd)
    assert torch.equal(loaded["model"]["layer.weight"], sd["model"]["layer.weight"])


@pytest.mark.anyio
async def test_async_save_reuses_the_callers_stager_and_stateful_values(
    one_rank_group: None, tmp_path: Path
) -> None:
    model = torch.nn.Linear(8, 4)
    async with DefaultStager() as stager:
        for name in ("a", "b"):
            handle = await astage.dcp.async_save(
                {"model": model}, checkpoint_id=tmp_path / name, stager=stager
            )
            await handle.wait()
        assert stager.last_stats is not None
        assert stager.last_stats.bytes_allocated == 0
    fresh = torch.nn.Linear(8, 4)
    dcp.load({"model": fresh}, checkpoint_id=tmp_path / "b")
    assert_same_tree(fresh.state_dict(), model.state_dict())


@pytest.mark.anyio
async def test_async_save_waiting_can_be_cancelled_and_resumed(
    one_rank_group: None, tmp_path: Path, gate: threading.Event
) -> None:
    handle = await astage.dcp.async_save(training_state(), checkpoint_id=tmp_path, planner=GatedPlanner(gate))
    with anyio.move_on_after(0.05) as scope:
        await handle.wait()
    assert scope.cancelled_caught
    gate.set()
    await handle.wait()
    assert (tmp_path / ".metadata").exists()


@pytest.mark.anyio
async def test_async_save_failures_are_persist_errors(one_rank_group: None, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    handle = await astage.dcp.async_save({"w": torch.zeros(2)}, checkpoint_id=blocker / "ckpt")
    with pytest.raises(PersistError, match=r"save to '.*ckpt' failed: rank 0: ") as caught:
        await handle.wait()
    assert isinstance(caught.value.__cause__, dcp.api.CheckpointException)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"state_dict": [torch.zeros(1)]}, UnsupportedInputError, "DCP saves a dict"),
        ({"state_dict": {("a",): torch.zeros(1)}}, UnsupportedInputError, "str top-level keys"),
        ({"state_dict": {"bad": torch.empty(1, device="meta")}}, UnsupportedInputError, "meta tensors"),
        ({"checkpoint_id": None}, ConfigurationError, "checkpoint_id or a storage_writer"),
        ({"checkpoint_id": 3}, ConfigurationError, "checkpoint_id must be"),
        ({"storage_writer": "dir"}, ConfigurationError, "storage_writer must be a StorageWriter"),
        ({"planner": object()}, ConfigurationError, "planner must be a SavePlanner"),
        ({"stager": StagerAdapter}, ConfigurationError, "stager must be an astage stager"),
        ({"no_dist": "yes"}, ConfigurationError, "no_dist must be a bool"),
        ({"process_group": dist.ProcessGroup}, ConfigurationError, "process_group must be"),
    ],
)
async def test_async_save_rejects_bad_input(
    tmp_path: Path, arguments: dict[str, Any], error: type[Exception], match: str
) -> None:
    call: dict[str, Any] = {"state_dict": {"w": torch.zeros(1)}, "checkpoint_id": tmp_path, **arguments}
    with pytest.raises(error, match=match):
        await astage.dcp.async_save(call.pop("state_dict"), **call)
    assert not [path async for path in anyio.Path(tmp_path).iterdir()]


@pytest.mark.anyio
async def test_async_save_checks_the_group_and_the_stager(one_rank_group: None, tmp_path: Path) -> None:
    stager = DefaultStager()
    await stager.aclose()
    with pytest.raises(ClosedError):
        await astage.dcp.async_save({"w": torch.zeros(1)}, checkpoint_id=tmp_path, stager=stager)
    group = dist.group.WORLD
    dist.destroy_process_group()
    try:
        with pytest.raises(ConfigurationError, match="not initialized"):
            await astage.dcp.async_save({"w": torch.zeros(1)}, checkpoint_id=tmp_path, process_group=group)
    finally:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


# -- two ranks ------------------------------------------------------------------------------


async def two_ranks(rank: int, world: int, directory: str) -> dict[str, bool]:
    """Save this rank's shard of a DTensor (plus replicated state) both ways, load, compare."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(world * 6 * 5, dtype=torch.float32).reshape(world * 6, 5)
    shard = full.chunk(world)[rank].clone()

    def state() -> dict[str, Any]:
        return {
            "model": {"sharded": DTensor.from_local(shard.clone(), mesh, [Shard(0)]), "bias": torch.ones(3)},
            "optim": {
                "state": {0: {"step": torch.tensor(2.0)}},
                "param_groups": [{"lr": 0.1, "params": [0]}],
            },
        }

    def check(path: Path) -> bool:
        target = state()
        target["model"]["sharded"] = DTensor.from_local(torch.zeros_like(shard), mesh, [Shard(0)])
        target["model"]["bias"].zero_()
        target["optim"]["state"][0]["step"].zero_()
        target["optim"]["param_groups"][0]["lr"] = None
        dcp.load(target, checkpoint_id=path)
        return (
            torch.equal(target["model"]["sharded"].to_local(), shard)
            and torch.equal(target["model"]["bias"], torch.ones(3))
            and float(target["optim"]["state"][0]["step"]) == 2.0
            and target["optim"]["param_groups"][0]["lr"] == 0.1
        )

    root = Path(directory)
    # The adapter is the synchronous API: blocking on its futures here is its normal use.
    with StagerAdapter() as adapter:
        sd = state()
        response = dcp.async_save(sd, checkpoint_id=root / "adapter", async_stager=adapter)
        assert isinstance(response, AsyncSaveResponse)
        response.staging_completion.result(timeout=30)
        sd["model"]["sharded"].to_local().zero_()
        response.upload_completion.result(timeout=30)
    sd = state()
    handle = await astage.dcp.async_save(sd, checkpoint_id=root / "native")
    sd["model"]["sharded"].to_local().zero_()
    await handle.wait()
    dist.barrier()
    return {"adapter": check(root / "adapter"), "native": check(root / "native")}


def test_two_ranks_save_their_shards_into_one_checkpoint(tmp_path: Path) -> None:
    results = run_group(2, two_ranks, str(tmp_path), timeout=60)
    assert [r.unwrap() for r in results] == [{"adapter": True, "native": True}] * 2
    for kind in ("adapter", "native"):
        assert sorted(p.name for p in (tmp_path / kind).iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        ]


# -- the example ---------------------------------------------------------------------------


def test_dcp_async_save_example(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "examples/dcp_async_save.py",
            "--steps",
            "6",
            "--every",
            "3",
            "--directory",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "restored step-000006: model and optimizer equal" in done.stdout
    assert "heartbeat lag during async_save() only" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000006"]
