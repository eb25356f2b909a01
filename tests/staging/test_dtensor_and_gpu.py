"""DTensor staging (a one-rank gloo group on CPU) and the device paths (GPU only)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from astage import DefaultStager, StagingOptions
from tests.statedicts import assert_same_tree, rich_state_dict, storage_key

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_dtensor_local_shard_is_staged_and_spec_kept(one_rank_group: None) -> None:
    mesh = init_device_mesh("cpu", (1,))
    local = torch.randn(4, 3)
    sharded = DTensor.from_local(local, mesh, [Shard(0)])
    replicated = DTensor.from_local(torch.randn(2), mesh, [Replicate()])
    async with DefaultStager() as stager:
        staged = await stager.stage({"w": sharded, "b": replicated})
    out = staged["w"]
    assert isinstance(out, DTensor)
    assert out.placements == sharded.placements
    assert out.device_mesh == mesh
    assert out.shape == sharded.shape
    assert torch.equal(out.to_local(), local)
    assert storage_key(out.to_local()) != storage_key(local)
    local.zero_()
    assert not torch.equal(out.to_local(), local)


@pytest.mark.gpu
async def test_cuda_state_dict_is_staged_to_pinned_memory() -> None:
    sd = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in rich_state_dict()["model"].items()}
    sd["big"] = torch.randn(64 << 20, device="cuda")
    async with DefaultStager(StagingOptions(use_pinned_memory=True, use_non_blocking_copy=True)) as stager:
        staged = await stager.stage(sd)
    for key, value in sd.items():
        assert staged[key].device.type == "cpu"
        assert staged[key].is_pinned()
        assert torch.equal(staged[key], value.cpu())
    assert storage_key(staged["weight"]) == storage_key(staged["weight_t"])


@pytest.mark.gpu
async def test_side_stream_waits_for_pending_compute() -> None:
    x = torch.ones(8 << 20, device="cuda")
    async with DefaultStager() as stager:
        for _ in range(50):  # long work on the compute stream, still running when staging starts
            x.mul_(1.0001)
        expected_stream = torch.cuda.current_stream()
        staged = await stager.stage({"x": x})
        assert torch.cuda.current_stream() == expected_stream
    assert torch.equal(staged["x"], x.cpu())


@pytest.mark.gpu
async def test_mixed_cpu_and_cuda_sources() -> None:
    sd = {"cpu": torch.randn(100), "gpu": torch.randn(100, device="cuda")}
    async with DefaultStager() as stager:
        staged = await stager.stage(sd)
    assert_same_tree({k: v for k, v in staged.items()}, {k: v.cpu() for k, v in sd.items()})
