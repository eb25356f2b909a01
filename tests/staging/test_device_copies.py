"""Device copies go on a side stream of their own device, and a stage waits for every device.

A non-blocking device-to-host copy runs on the current stream of its *source's* device.  A
state_dict spread over several GPUs (a model split across them, ``device_map="auto"``), or
one on another GPU than the one current when the stager was made, must still have each
device's copies ordered after that device's compute stream and finished before ``stage()``
returns: one side stream and one event per device.  The layout and the grouping are pure
and tested here without a GPU; the copies themselves need one (two, for the cross-device
cases), and skip cleanly otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from astage import DefaultStager, StagingOptions
from astage._staging.copies import Batch, copy_layout_in_slices, group_by_device
from astage._staging.plan import plan_state_dict
from astage._util.timeslice import drive
from tests.statedicts import assert_same_tree

pytestmark = pytest.mark.anyio


def _on_devices(devices: list[str]) -> tuple[Any, Any, list[torch.device]]:
    """A plan of one small storage per entry of ``devices``, its storages moved there on paper
    (the layout reads only the plan's devices and the sources' sizes)."""
    sd = {f"t{i}": torch.full((4 + i,), float(i)) for i in range(len(devices))}
    source = plan_state_dict(sd)
    moved = tuple(
        spec._replace(device=torch.device(devices[s])) for s, spec in enumerate(source.plan.storages)
    )
    plan = dataclasses.replace(source.plan, storages=moved)
    return plan, source.tensors, [spec.device for spec in moved]


def test_a_device_batch_never_mixes_devices() -> None:
    devices = ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:1", "cuda:0", "cpu", "cuda:1"]
    plan, sources, storage_devices = _on_devices(devices)
    layout = drive(copy_layout_in_slices(plan, sources))
    seen: list[int] = []
    for batch in layout.device:
        storages = [plan.tensors[i].storage for i in batch]
        assert len({storage_devices[s] for s in storages}) == 1, storages
        seen += storages
    on_gpu = [s for s, d in enumerate(devices) if d != "cpu"]
    assert sorted(seen) == on_gpu  # every device storage once, the host one on the host
    assert [plan.tensors[i].storage for batch in layout.host for i in batch] == [devices.index("cpu")]
    for device in ("cuda:0", "cuda:1"):  # each device's storages keep their order
        assert [s for s in seen if devices[s] == device] == [s for s in on_gpu if devices[s] == device]


def test_batches_are_grouped_by_their_sources_device_in_order() -> None:
    def batch(device: str, n: int) -> Batch:
        return [torch.empty(n)], [torch.empty(n, device=device)]

    batches = [batch("cpu", 1), batch("meta", 2), batch("cpu", 3), batch("meta", 4)]
    groups = group_by_device(batches)
    assert list(groups) == [torch.device("cpu"), torch.device("meta")]
    assert groups[torch.device("cpu")] == [batches[0], batches[2]]
    assert groups[torch.device("meta")] == [batches[1], batches[3]]


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _busy(device: str) -> torch.Tensor:
    """Work queued on ``device``'s compute stream, still running when a stage starts."""
    x = torch.ones(8 << 20, device=device)
    for _ in range(50):
        x.mul_(1.0001)
    return x


NON_BLOCKING = StagingOptions(use_pinned_memory=True, use_non_blocking_copy=True)


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA devices")
async def test_a_state_dict_over_two_gpus_is_staged_whole() -> None:
    sd: dict[str, Any] = {}
    for i in range(12):  # interleaved devices, small and large storages
        device = f"cuda:{i % 2}"
        sd[f"w{i}"] = torch.randn((64 << 20) if i % 5 == 0 else 1000 + i, device=device)
    sd["busy0"], sd["busy1"] = _busy("cuda:0"), _busy("cuda:1")
    async with DefaultStager(NON_BLOCKING) as stager:
        for _ in range(3):  # first stage, then refills
            for t in sd.values():
                t.add_(1.0)  # queued on each device's compute stream right before the stage
            staged = await stager.stage(sd)
            assert_same_tree(staged, {k: v.cpu() for k, v in sd.items()})
            await stager.release(staged)


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs two CUDA devices")
async def test_a_stager_made_on_one_gpu_stages_a_state_dict_on_another() -> None:
    with torch.cuda.device(0):
        stager = DefaultStager(NON_BLOCKING)  # its first side stream is on cuda:0
    async with stager:
        with torch.cuda.device(1):
            x = _busy("cuda:1")
            staged = await stager.stage({"x": x})
        assert torch.equal(staged["x"], x.cpu())


@pytest.mark.gpu
async def test_one_gpu_and_the_host_in_one_state_dict_are_staged_whole_again_and_again() -> None:
    sd = {"gpu": _busy("cuda"), "cpu": torch.randn(1000), "small": torch.randn(10, device="cuda")}
    async with DefaultStager(NON_BLOCKING) as stager:
        for _ in range(3):
            sd["gpu"].add_(1.0)
            staged = await stager.stage(sd)
            assert_same_tree(staged, {k: v.cpu() for k, v in sd.items()})
            await stager.release(staged)
