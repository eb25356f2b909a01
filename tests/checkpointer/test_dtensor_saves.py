"""DTensor-heavy states through the Checkpointer: an FSDP2 model and its AdamW state on two
gloo ranks, saved with and without replication, read back bit-exact.

A DTensor's note (placements, global shape) is charged by the header parser; a header
whose padding the encoder sized without those charges was refused on reading, and with
~300 DTensors a rank (a 6-layer transformer under FSDP2) every save failed or committed a
file that no restore could read.
"""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

import astage
from astage._files.reading import find_replicas, load_checkpoint_file
from astage._format.codec import FORMAT_VERSION, parse_prefix
from tests.distributed import run_group
from tests.fsdp2_job import fsdp2_job, train_step


def fsdp2_state() -> dict[str, Any]:
    """An FSDP2-sharded transformer's model and AdamW state after one step (this rank's)."""
    model, optim = fsdp2_job()
    train_step(model, optim, 1, dist.get_rank())
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": 5}


def _dtensors(tree: Any) -> int:
    if isinstance(tree, DTensor):
        return 1
    if isinstance(tree, dict):
        return sum(map(_dtensors, tree.values()))
    if isinstance(tree, list | tuple):
        return sum(map(_dtensors, tree))
    return 0


def _locals(tree: Any) -> Any:
    """``tree`` as a checkpoint file reads it back: each DTensor its local tensor."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return type(tree)((key, _locals(value)) for key, value in tree.items())
    if isinstance(tree, list):
        return [_locals(value) for value in tree]
    return tree


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same_bits(got: Any, want: Any, path: str = "") -> None:
    """Bit-exact: the same tree, tensors of the same type, dtype, shape, stride and bytes."""
    assert type(got) is type(want), path
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride(), got.requires_grad, got.is_neg(), got.is_conj()) == (
            want.dtype,
            want.shape,
            want.stride(),
            want.requires_grad,
            want.is_neg(),
            want.is_conj(),
        ), path
        assert _bytes(got) == _bytes(want), path
    elif isinstance(want, dict):
        assert list(got) == list(want), path
        for key in want:
            _same_bits(got[key], want[key], f"{path}/{key}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _same_bits(a, b, f"{path}/{i}")
    else:
        assert got == want, path


async def fsdp2_saves(rank: int, world: int, root: str) -> int:
    """Save an FSDP2 state through the Checkpointer without and with replication, restore it."""
    state = fsdp2_state()
    count = _dtensors(state)
    want = _locals(state)
    base = Path(root)
    async with astage.Checkpointer(base / "plain", rank=rank) as ckpt:
        await ckpt.save(5, state)
        await ckpt.wait()
    async with astage.Checkpointer(base / "plain", rank=rank) as fresh:
        _same_bits(await fresh.restore(5), want)
    async with (
        astage.ReplicationStager(storage_dir=base / f"replicas{rank}", timeout=60) as replication,
        astage.Checkpointer(base / "replicated", rank=rank, replication=replication) as ckpt,
    ):
        await ckpt.save(5, state)
        await ckpt.wait()
    dist.barrier()  # both ranks' replicas are durable
    async with astage.Checkpointer(base / "replicated", rank=rank) as fresh:
        _same_bits(await fresh.restore(5), want)
    # The replica this rank holds of its peer's state reads back too.
    peer = (rank + 1) % world
    found = await anyio.to_thread.run_sync(find_replicas, base / f"replicas{rank}")
    (replica,) = [info for info in found if info.owner_rank == peer]
    peer_state = await load_checkpoint_file(replica.path)
    assert _dtensors(peer_state) == 0
    assert len(peer_state["optim"]["state"]) == len(want["optim"]["state"])
    return count


def test_an_fsdp2_state_saves_and_restores_bit_exact_with_and_without_replication(tmp_path: Path) -> None:
    counts = [r.unwrap() for r in run_group(2, fsdp2_saves, str(tmp_path), timeout=120)]
    assert min(counts) >= 300  # as many DTensors as the job that lost its saves


# A version-4 file the encoder of astage 2e3cf27 wrote for 300 DTensors (zeros, Shard(0)) and 300
# scalar tensors: it committed, but that astage's reader refused it as "too dense" (the
# encoder had not paid for the DTensor notes). zlib-compressed, base64.
_LOST_VERSION_4 = Path(__file__).resolve().parents[1] / "data" / "format4_300_dtensors.zlib.b64"


def test_a_version_4_file_with_unpaid_dtensor_notes_is_refused_naming_its_version() -> None:
    # It read again from the version-5 reader on (its notes charged as version 4 paid for
    # them); only the current version is read now, and this file is refused whole, with
    # the versions named, before its tables or notes are looked at.  (The notes of 300 and
    # 3,000 DTensors written now: tests/format/test_parse_cost.py.)
    data = zlib.decompress(base64.b64decode(_LOST_VERSION_4.read_bytes()))
    assert struct.unpack_from("<I", data, 8)[0] == 4
    with pytest.raises(
        astage.IntegrityError, match=f"version 4: this astage reads only version {FORMAT_VERSION}"
    ):
        parse_prefix(data)
