"""``io.BytesIO`` values wherever a state_dict goes: staged, saved, replicated, under DCP.

DCP saves a BytesIO as an item of its own (train-state code keeps dataloader or RNG state
in one) and torch's stager copies it.  astage stages it as a new BytesIO holding a copy of
its bytes at the same position, independent of the source both ways, copied anew at every
stage; a checkpoint file stores its bytes (checksummed) and reads back a BytesIO at
position 0.  Real files, real DCP, real gloo groups.
"""

from __future__ import annotations

import io
import json
import os
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed.checkpoint as dcp

import astage
import astage.dcp
from astage import UnsupportedInputError
from astage._files.durable import write_checkpoint_file
from astage._format.codec import encode, parse_prefix
from astage.cli import main
from tests.distributed import run_group
from tests.format.test_format import _T, _set, _table_edit, read
from tests.helpers import no_blocking_calls_on_the_loop  # noqa: F401 - autouse fixture

SCALE = int(os.environ.get("ASTAGE_SOAK_SCALE", "1"))

OPTIONS = {
    "default": astage.StagingOptions(),
    "skip_unchanged": astage.StagingOptions(skip_unchanged=True),
    "capped": astage.StagingOptions(max_staging_bytes=1 << 20, skip_unchanged=True),
    "unpinned": astage.StagingOptions(use_pinned_memory=False, use_async_staging=False),
}


def stream(data: bytes, position: int | None = None) -> io.BytesIO:
    """A BytesIO written (not initialised) with ``data``, at ``position`` (default: its end)."""
    out = io.BytesIO()
    out.write(data)
    if position is not None:
        out.seek(position)
    return out


def train_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    blob = stream(os.urandom(3 << 20), position=17)  # large: copied off the loop
    return {
        "model": {"w": torch.randn(64, generator=g), "b": torch.zeros(3)},
        "dataloader": blob,
        "same_again": blob,  # one BytesIO met twice
        "rng": stream(b"rng-state", position=0),
        "empty": io.BytesIO(),
        "nested": [{"inner": stream(b"x" * 100, position=100)}],
        "step": 5,
    }


def assert_bytes_ios(got: Any, want: Any, *, positions: bool) -> None:
    """Every BytesIO of ``want`` has a BytesIO in ``got`` with equal bytes (and position),
    never the same object; everything else equal (tensors bitwise)."""
    if isinstance(want, io.BytesIO):
        assert type(got) is io.BytesIO
        assert got is not want
        assert got.getvalue() == want.getvalue()
        assert got.tell() == (want.tell() if positions else 0)
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_bytes_ios(got[key], want[key], positions=positions)
    elif isinstance(want, list):
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_bytes_ios(a, b, positions=positions)
    else:
        assert got == want


# -- staging ---------------------------------------------------------------------------------


@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
@pytest.mark.anyio
async def test_a_staged_bytes_io_is_a_new_one_with_the_same_bytes_and_position(
    options: astage.StagingOptions,
) -> None:
    sd = train_state()
    before = {key: sd[key].getvalue() for key in ("dataloader", "rng")}
    async with astage.DefaultStager(options) as stager:
        staged = await stager.stage(sd)
        assert_bytes_ios(staged, sd, positions=True)
        assert staged["same_again"] is staged["dataloader"]  # identity kept, as for containers
        # Independent both ways: the source's writes do not reach the copy, nor the reverse.
        sd["dataloader"].seek(0)
        sd["dataloader"].write(b"SOURCE")
        staged["rng"].seek(0)
        staged["rng"].write(b"STAGED")
        assert staged["dataloader"].getvalue() == before["dataloader"]
        assert sd["rng"].getvalue() == before["rng"]
        assert sd["dataloader"].getvalue()[:6] == b"SOURCE"


@pytest.mark.anyio
async def test_blocking_stager_and_type_check_stage_bytes_io() -> None:
    sd = train_state()
    async with astage.BlockingStager(type_check=True) as stager:
        assert_bytes_ios(await stager.stage(sd), sd, positions=True)


@pytest.mark.parametrize("options", list(OPTIONS.values()), ids=list(OPTIONS))
@pytest.mark.anyio
async def test_every_stage_copies_the_current_bytes_never_an_earlier_stages(
    options: astage.StagingOptions,
) -> None:
    # The reuse paths (a kept plan, a released copy refilled in place, unchanged storages
    # skipped) must never hand back the bytes of an earlier stage: random edits between
    # stages, of the same size and of other sizes, at other positions.
    rng = random.Random(7)
    sd = {"w": torch.arange(256.0), "blob": stream(b"a" * 1000, 3), "meta": {"lr": 0.1}}
    async with astage.DefaultStager(options) as stager:
        for round_ in range(40 * SCALE):
            blob = sd["blob"]
            match rng.randrange(5):
                case 0:  # the same size, other bytes
                    blob.seek(rng.randrange(len(blob.getvalue()) or 1))
                    blob.write(bytes([rng.randrange(256)]))
                case 1:  # longer
                    blob.seek(0, io.SEEK_END)
                    blob.write(os.urandom(rng.randrange(1, 5000)))
                case 2:  # shorter
                    blob.truncate(rng.randrange(len(blob.getvalue()) + 1))
                case 3:  # a new BytesIO object in the same place
                    sd["blob"] = stream(os.urandom(rng.randrange(0, 3000)))
                case 4:  # only the position
                    blob.seek(rng.randrange(2000))
            sd["meta"]["lr"] = round_ / 10
            staged = await stager.stage(sd)
            assert staged["blob"].getvalue() == sd["blob"].getvalue()
            assert staged["blob"].tell() == sd["blob"].tell()
            assert staged["meta"]["lr"] == round_ / 10
            if rng.randrange(2):
                await stager.release(staged)
            del staged


class GetbufferCalls:
    """Threads that called ``getbuffer`` on one BytesIO while profiled (sys.setprofile)."""

    def __init__(self, watched: io.BytesIO) -> None:
        self.watched = watched
        self.on_this_thread = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        watched = event == "c_call" and getattr(arg, "__self__", None) is self.watched
        if watched and getattr(arg, "__name__", "") == "getbuffer":
            self.on_this_thread += 1


@pytest.mark.anyio
async def test_the_bytes_are_copied_in_a_worker_thread_not_on_the_loop() -> None:
    for stager, on_loop in ((astage.DefaultStager(), 0), (astage.BlockingStager(), 1)):
        sd = train_state()
        calls = GetbufferCalls(sd["dataloader"])
        async with stager:
            sys.setprofile(calls)  # this thread only: worker threads are not profiled
            try:
                staged = await stager.stage(sd)
            finally:
                sys.setprofile(None)
        assert staged["dataloader"].getvalue() == sd["dataloader"].getvalue()
        assert calls.on_this_thread == on_loop  # the blocking stager proves the probe works


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: _closed(), "closed io.BytesIO"),
        (lambda: _with_attribute(), r"attributes \('tag'\)"),
        (lambda: io.StringIO("text"), "only io.BytesIO itself is staged"),
        (lambda: type("Sub", (io.BytesIO,), {})(b"x"), "only io.BytesIO itself is staged"),
    ],
    ids=["closed", "attributes", "StringIO", "subclass"],
)
async def test_what_cannot_be_staged_is_refused_with_its_key_path(make: Any, match: str) -> None:
    async with astage.DefaultStager() as stager:
        with pytest.raises(UnsupportedInputError, match=match) as info:
            await stager.stage({"ok": io.BytesIO(b"fine"), "bad": [make()]})
    assert info.value.key_path == ("bad", 0)


def _closed() -> io.BytesIO:
    out = io.BytesIO(b"gone")
    out.close()
    return out


def _with_attribute() -> io.BytesIO:
    out = io.BytesIO(b"x")
    out.tag = 1  # type: ignore[attr-defined]
    return out


# -- checkpoint files --------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_checkpointer_saves_and_restores_bytes_io(tmp_path: Path) -> None:
    sd = train_state()
    async with astage.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            sd["rng"].seek(0)
            sd["rng"].write(f"rng-{step}".encode())  # each save stores the bytes of its time
            await ckpt.save(step, sd)
            await ckpt.wait()
        first = await ckpt.restore(1)
        restored = await ckpt.restore()
    assert first["rng"].getvalue() == b"rng-1tate"
    assert_bytes_ios(restored, sd, positions=False)  # a file reads back at position 0
    assert restored["same_again"] is restored["dataloader"]
    path = tmp_path / "step_0000000002" / "rank00000.astage"
    assert_bytes_ios(astage.load_checkpoint_file_sync(path), sd, positions=False)


@pytest.mark.anyio
async def test_a_damaged_bytes_io_is_an_integrity_error(tmp_path: Path) -> None:
    sd = {"blob": stream(b"payload" * 1000)}
    async with astage.Checkpointer(tmp_path) as ckpt:
        await ckpt.save(1, sd)
        await ckpt.wait()
    path = tmp_path / "step_0000000001" / "rank00000.astage"
    data = bytearray(path.read_bytes())
    header = parse_prefix(bytes(data))
    data[header.prefix_nbytes + header.segments[0].offset + 5] ^= 1  # inside the BytesIO's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(astage.IntegrityError, match="checksum"):
        astage.load_checkpoint_file_sync(path)


def test_encode_and_decode_bytes_io_of_every_size() -> None:
    for n in (0, 1, 7, 4096, 100_003):
        data = os.urandom(n)
        tree = {"a": stream(data, position=n // 2), "b": [io.BytesIO(data)]}
        back = read(b"".join(encode(tree, owner_rank=0, step=1, checkpoint_id="x").buffers()))
        assert back["a"].getvalue() == data
        assert back["a"].tell() == 0
        assert back["b"][0].getvalue() == data
        assert back["a"] is not back["b"][0]


_BYTESIO_STATE = {"blob": io.BytesIO(b"0123456789abcdef"), "t": torch.zeros(2)}


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (_set(_T, 1, "kind", 3), "bytesio entry is uint8"),  # the float32 tensor as a bytesio
        (_set(_T, 0, "flags", 1), "cannot carry requires_grad"),
        (_set(_T, 0, "kind", 4), "kind code"),
    ],
    ids=["float32 as a bytesio", "bytesio requiring grad", "unknown kind code"],
)
def test_a_malformed_bytesio_entry_is_refused(edit: Any, fragment: str) -> None:
    assert read(_table_edit(lambda *tables: None, _BYTESIO_STATE))["blob"].getvalue() == b"0123456789abcdef"
    with pytest.raises(astage.IntegrityError, match="header") as info:
        read(_table_edit(edit, _BYTESIO_STATE))
    assert fragment in str(info.value)


def test_inspect_shows_a_bytes_io(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "loose" / "rank00000.astage"
    path.parent.mkdir()
    encoded = encode(train_state(), owner_rank=0, step=1, checkpoint_id="c")
    anyio.run(write_checkpoint_file, path, encoded)
    assert main(["inspect", "--json", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {row["key_path"]: row for row in doc["leaves"]}
    assert rows["['dataloader']"] | {"storage": 0} == {
        "key_path": "['dataloader']", "type": "bytesio", "dtype": "uint8", "shape": [3 << 20], "storage": 0,
        "nbytes": 3 << 20,
    }  # fmt: skip
    assert rows["['empty']"]["shape"] == [0]
    assert main(["inspect", str(path)]) == 0
    assert "bytesio" in capsys.readouterr().out


# -- torch.distributed.checkpoint ----------------------------------------------------------------


def dcp_target() -> dict[str, Any]:
    return {"w": torch.zeros(64), "dataloader": io.BytesIO(), "rng": io.BytesIO()}


def test_the_adapter_under_dcp_async_save_saves_bytes_io(tmp_path: Path) -> None:
    sd = {"w": torch.randn(64), "dataloader": stream(os.urandom(1 << 20), 5), "rng": stream(b"r", 0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.distributed is not initialised
        with astage.dcp.StagerAdapter() as adapter:
            response = dcp.async_save(sd, checkpoint_id=tmp_path, async_stager=adapter)
            response.upload_completion.result(timeout=60)
        target = dcp_target()
        dcp.load(target, checkpoint_id=tmp_path)
    assert torch.equal(target["w"], sd["w"])
    assert target["dataloader"].getvalue() == sd["dataloader"].getvalue()
    assert target["rng"].getvalue() == b"r"


@pytest.mark.anyio
async def test_astage_dcp_async_save_saves_bytes_io(tmp_path: Path) -> None:
    sd = {"w": torch.randn(64), "dataloader": stream(os.urandom(1 << 20), 5), "rng": stream(b"r", 0)}
    expected = sd["dataloader"].getvalue()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        handle = await astage.dcp.async_save(sd, checkpoint_id=tmp_path, no_dist=True)
        sd["dataloader"].seek(0)
        sd["dataloader"].write(b"changed after staging")  # training goes on: not in the file
        await handle.wait()
        target = dcp_target()
        await anyio.to_thread.run_sync(lambda: dcp.load(target, checkpoint_id=tmp_path, no_dist=True))
    assert target["dataloader"].getvalue() == expected


# -- replication -------------------------------------------------------------------------------


def rank_blob(rank: int, step: int) -> bytes:
    return f"rank {rank} step {step} ".encode() * (1000 + rank)


async def replication_target(rank: int, world: int, root: str) -> dict[str, bool]:
    storage = Path(root) / f"rank{rank}"
    peer = 1 - rank
    out: dict[str, bool] = {}
    blob = stream(rank_blob(rank, 1), position=3)
    sd = {"w": torch.full((8,), float(rank)), "blob": blob, "again": blob}
    async with astage.ReplicationStager(storage_dir=storage / "replicas", timeout=60, keep=2) as rs:
        result = await rs.replicate(sd, step=1)
        out["staged"] = (
            result.staged["blob"].getvalue() == rank_blob(rank, 1) and result.staged["blob"].tell() == 3
        )
        out["replica"] = result.replica["blob"].getvalue() == rank_blob(peer, 1)
        out["replica aliasing"] = result.replica["again"] is result.replica["blob"]
        loaded = await astage.load_checkpoint_file(result.replica_path)
        out["replica file"] = loaded["blob"].getvalue() == rank_blob(peer, 1) and loaded["blob"].tell() == 0
        # A later stage of the same structure sends the bytes of its own time.
        blob.seek(0)
        blob.write(rank_blob(rank, 2))
        second = await rs.replicate(sd, step=2)
        out["second replica"] = second.replica["blob"].getvalue() == rank_blob(peer, 2)
        recovered = await rs.recover()
        out["recovered"] = recovered is not None and recovered["blob"].getvalue() == rank_blob(rank, 2)
        async with astage.Checkpointer(Path(root) / "ckpt", rank=rank, replication=rs, keep=2) as ckpt:
            await ckpt.save(3, sd)
            await ckpt.wait()
            restored = await ckpt.restore(3)
        out["restored"] = restored["blob"].getvalue() == rank_blob(rank, 2)
    return out


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_replication_sends_and_keeps_bytes_io(tmp_path: Path, backend: str) -> None:
    for result in run_group(2, replication_target, str(tmp_path), backend=backend, timeout=120):
        value = result.unwrap()
        assert all(value.values()), value
