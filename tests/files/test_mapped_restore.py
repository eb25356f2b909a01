"""``restore()`` without a destination over a private mapping of the file (bodies of
``MAP_MIN_BYTES`` and more; here any size): every byte verified in place, the tensors
over the mapping, which outlives the file's removal and never writes back to it."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import astage
from astage._files import body_reads
from astage._files.directory import step_dir_name
from tests.helpers import no_blocking_calls_on_the_loop, run_cancelled_at  # noqa: F401 - autouse fixture
from tests.statedicts import assert_same_tree, rich_state_dict

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps (Linux)"),
]


@pytest.fixture(autouse=True)
def map_every_body(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(body_reads, "MAP_MIN_BYTES", 1)


def state(seed: int = 0) -> dict[str, Any]:
    """Views, tied Parameters, every dtype, an empty and a 0-d tensor, non-tensor leaves."""
    rich = rich_state_dict()
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": rich["model"],
        "optim": rich["optim"],
        "frozen_param": rich["frozen_param"],
        "empty": rich["empty"],
        "scalar": rich["scalar"],
        "dtypes": rich["dtypes"],
        "big": torch.randn(300_000, generator=gen),  # several checks a lane
        "array": np.arange(10, dtype=np.int32) + seed,
        "blob": io.BytesIO(b"opaque %d" % seed),
        "extras": [seed, 2.5, "text", None, True, b"bytes"],
    }


def mapped(path: Path) -> bool:
    """Whether this process maps ``path`` now."""
    return str(path) in Path("/proc/self/maps").read_text()


def file_of(directory: Path, step: int) -> Path:
    return directory / step_dir_name(step) / "rank00000.astage"


async def test_a_mapped_restore_is_bit_exact_and_its_tensors_view_the_file(tmp_path: Path) -> None:
    source = state(1)
    async with astage.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, source)).wait()
        path = file_of(tmp_path, 1)
        assert not mapped(path)
        got = await ckpt.restore()
    assert mapped(path)
    tensors = {key: value for key, value in source.items() if key not in ("array", "blob")}
    assert_same_tree({key: got[key] for key in tensors}, tensors)
    assert got["array"].tolist() == source["array"].tolist()
    assert got["blob"].getvalue() == source["blob"].getvalue()
    del got
    assert not mapped(path)  # unmapped with the last tensor over it


async def test_a_mapped_restore_outlives_the_file_and_never_writes_to_it(tmp_path: Path) -> None:
    source = state(1)
    async with astage.Checkpointer(tmp_path, keep=1) as ckpt:
        await (await ckpt.save(1, source)).wait()
        path = file_of(tmp_path, 1)
        before = path.read_bytes()
        got = await ckpt.restore()
        got["big"].fill_(7.0)  # a private mapping: the write copies its pages
        assert path.read_bytes() == before
        await (await ckpt.save(2, state(2))).wait()  # retention removes step 1's file
        assert not path.exists()
    assert bool((got["big"] == 7.0).all())
    assert_same_tree(got["dtypes"], source["dtypes"])


@pytest.mark.parametrize("where", ["storage", "padding"])
async def test_a_byte_flipped_in_a_mapped_body_is_refused(tmp_path: Path, where: str) -> None:
    async with astage.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state(1))).wait()
    path = file_of(tmp_path, 1)
    header = astage.inspect_checkpoint_file(path).header
    offsets, sizes = header.segments.offsets.tolist(), header.segments.nbytes.tolist()
    if where == "storage":
        big = max(range(len(sizes)), key=sizes.__getitem__)
        at = header.prefix_nbytes + offsets[big] + sizes[big] // 2
    else:
        gap = next(i for i in range(len(sizes) - 1) if offsets[i] + sizes[i] < offsets[i + 1])
        at = header.prefix_nbytes + offsets[gap] + sizes[gap]
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    message = "checksum mismatch" if where == "storage" else "non-zero padding"
    async with astage.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(astage.IntegrityError, match=message):
            await ckpt.restore()
    assert not mapped(path)  # no idle worker thread, no traceback keeps it


async def test_a_truncated_file_is_read_not_mapped_and_refused(tmp_path: Path) -> None:
    async with astage.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, state(1))).wait()
    path = file_of(tmp_path, 1)
    os.truncate(path, path.stat().st_size - 100)  # past its end, a mapping would fault (SIGBUS)
    async with astage.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(astage.IntegrityError, match="truncated"):
            await ckpt.restore()


async def test_a_mapped_restore_cancelled_at_every_await_leaves_no_mapping(tmp_path: Path) -> None:
    source = state(3)
    async with astage.Checkpointer(tmp_path) as ckpt:
        await (await ckpt.save(1, source)).wait()
        path = file_of(tmp_path, 1)
        points = 0
        while (outcome := await run_cancelled_at(points, ckpt.restore)).cancelled:
            assert not mapped(path), f"a mapping left by a restore cancelled at step {points}"
            points += 1
            assert points < 2000
        got = outcome.value
    assert points >= 3, points
    assert_same_tree(got["big"], source["big"])
