"""Durable replica files: real files, real fsync, real failures; no mocks."""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import random
import re
import signal
import stat
import struct
import subprocess
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import crc32c
import pytest
import torch

import astage
from astage._files import durable as _persist
from astage._files.durable import (
    CheckpointFileWriter,
    blocking_io,
    is_temp_name,
    replica_path,
    sweep_stale_temps,
    temp_path_for,
    write_checkpoint_file,
)
from astage._files.reading import find_replicas, load_checkpoint_file, load_checkpoint_file_sync
from astage._format import codec as _format
from astage._format.codec import Encoded, encode
from tests.helpers import no_blocking_calls_on_the_loop, tmpfs  # noqa: F401 - autouse fixture


def state(seed: int, nbytes: int = 4096) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(max(nbytes // 4, 4), generator=g)
    return {
        "model": {"w": base, "w_view": base[2:], "b": torch.arange(seed, seed + 3)},
        "step": seed,
        "names": ["a", "b"],
    }


def encoded(seed: int, nbytes: int = 4096, owner: int = 0, holder: int = 1) -> Encoded:
    return encode(
        state(seed, nbytes), owner_rank=owner, holder_rank=holder, step=seed, checkpoint_id=f"c{seed}"
    )


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            type(a) is type(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# -- writing and loading ------------------------------------------------------------------


@pytest.mark.anyio
async def test_write_then_load_round_trips(tmp_path: Path) -> None:
    path = replica_path(tmp_path / "a" / "b", owner_rank=3, holder_rank=1)
    assert path.name == "replica-owner00003-holder00001.astage"
    assert await write_checkpoint_file(path, encoded(1)) == path
    loaded = await load_checkpoint_file(path)
    assert same(state(1), loaded)
    assert (
        loaded["model"]["w_view"].untyped_storage().data_ptr()
        == loaded["model"]["w"].untyped_storage().data_ptr()
    )
    assert same(state(1), await anyio.to_thread.run_sync(load_checkpoint_file_sync, path))
    assert files(path.parent) == [path.name]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "a").stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


@pytest.mark.anyio
async def test_a_newer_replica_replaces_the_older(tmp_path: Path) -> None:
    path = replica_path(tmp_path, owner_rank=0, holder_rank=1)
    await write_checkpoint_file(path, encoded(1))
    await write_checkpoint_file(path, encoded(2, nbytes=100_000))
    assert same(state(2, 100_000), await load_checkpoint_file(path))
    assert files(tmp_path) == [path.name]


@pytest.mark.anyio
async def test_writer_streams_chunks_as_they_arrive(tmp_path: Path) -> None:
    replica = encoded(5, nbytes=300_000)
    data = b"".join(replica.buffers())

    async def arriving() -> AsyncIterator[bytes]:
        rng = random.Random(0)
        at = 0
        while at < len(data):
            n = rng.randint(1, 70_000)
            yield data[at : at + n]
            at += n
            await anyio.lowlevel.checkpoint()

    path = tmp_path / "streamed.astage"
    async with CheckpointFileWriter(path, chunk_nbytes=4096) as writer:
        async for chunk in arriving():
            await writer.write(chunk)
        await writer.write([b"", memoryview(b"")])
        assert writer.nbytes_written == len(data)
        await writer.commit()
    assert path.read_bytes() == data
    assert same(state(5, 300_000), await load_checkpoint_file(path))


@pytest.mark.anyio
async def test_leaving_without_commit_discards(tmp_path: Path) -> None:
    path = tmp_path / "r.astage"
    await write_checkpoint_file(path, encoded(1))
    async with CheckpointFileWriter(path) as writer:
        await writer.write(b"partial")
        assert writer.temp_path.exists()
    assert files(tmp_path) == [path.name]
    writer = CheckpointFileWriter(path)

    async def fail_while_writing() -> None:
        async with writer:
            await writer.write(b"partial")
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await fail_while_writing()
    assert files(tmp_path) == [path.name]
    assert same(state(1), await load_checkpoint_file(path))
    with pytest.raises(astage.ClosedError):
        await writer.write(b"late")
    with pytest.raises(astage.ClosedError):
        await writer.commit()
    await writer.aclose()


@pytest.mark.anyio
async def test_cancellation_at_each_chunk_leaves_no_temp_and_the_old_replica(tmp_path: Path) -> None:
    path = tmp_path / "r.astage"
    await write_checkpoint_file(path, encoded(1))
    big = encoded(2, nbytes=1 << 20)
    pieces = list(big.buffers(64 << 10))
    for cancel_after in (0, 1, 2, 5, len(pieces) // 2, len(pieces) - 1):
        with anyio.CancelScope() as scope:

            def cancelling(scope: anyio.CancelScope = scope, k: int = cancel_after) -> Iterator[memoryview]:
                for i, piece in enumerate(pieces):
                    if i == k:
                        scope.cancel()
                    yield piece

            await write_checkpoint_file(path, cancelling(), chunk_nbytes=64 << 10)
        assert scope.cancelled_caught, cancel_after
        assert files(tmp_path) == [path.name]
        assert same(state(1), await load_checkpoint_file(path))


@pytest.mark.anyio
async def test_cancellation_before_commit_and_by_timeout(tmp_path: Path) -> None:
    path = tmp_path / "r.astage"
    await write_checkpoint_file(path, encoded(1))
    big = encoded(2, nbytes=32 << 20)
    with anyio.CancelScope() as scope:
        async with CheckpointFileWriter(path) as writer:
            await writer.write(big.buffers())
            scope.cancel()
            await writer.commit()
    assert scope.cancelled_caught
    assert files(tmp_path) == [path.name]
    assert same(state(1), await load_checkpoint_file(path))
    for delay in (0.0, 0.001, 0.005, 0.02):
        with anyio.move_on_after(delay):
            await write_checkpoint_file(path, big, chunk_nbytes=1 << 20)
        assert files(tmp_path) == [path.name]
        loaded = await load_checkpoint_file(path)
        assert same(state(1), loaded) or same(state(2, 32 << 20), loaded)


@pytest.mark.anyio
async def test_cancellation_at_random_moments_never_leaks(tmp_path: Path) -> None:
    path = tmp_path / "new" / "r.astage"
    replicas = [encoded(1), encoded(2, nbytes=200_000)]
    rng = random.Random(7)
    cancelled = 0
    for i in range(60):
        with anyio.move_on_after(rng.uniform(0, 0.003)) as scope:
            await write_checkpoint_file(path, replicas[i % 2], chunk_nbytes=16 << 10)
        cancelled += scope.cancelled_caught
        assert not any(is_temp_name(n) for n in (files(path.parent) if path.parent.exists() else []))
        if path.exists():
            loaded = await load_checkpoint_file(path)
            assert same(state(1), loaded) or same(state(2, 200_000), loaded)
    assert cancelled


@pytest.mark.anyio
async def test_a_parent_that_is_a_file_fails_clearly(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    path = tmp_path / "file" / "sub" / "r.astage"
    with pytest.raises(astage.PersistError, match="open failed") as info:
        await write_checkpoint_file(path, encoded(1))
    assert str(path) in str(info.value)
    assert isinstance(info.value.__cause__, OSError)
    assert files(tmp_path) == ["file"]


# -- real failures on small or read-only filesystems ---------------------------------------


def remount_read_only(where: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)


@pytest.mark.anyio
async def test_disk_full_fails_cleanly_and_keeps_the_old_replica(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "1m") as mnt:
        path = mnt / "r.astage"
        await write_checkpoint_file(path, encoded(1))
        with pytest.raises(astage.PersistError, match="write failed") as info:
            await write_checkpoint_file(path, encoded(2, nbytes=2 << 20))
        assert str(path) in str(info.value)
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.ENOSPC
        assert files(mnt) == [path.name]
        assert same(state(1), await load_checkpoint_file(path))


@pytest.mark.anyio
async def test_read_only_directory_fails_cleanly_and_keeps_the_old_replica(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        directory = tmp_path / "ro"
        path = directory / "r.astage"
        await write_checkpoint_file(path, encoded(1))
        directory.chmod(0o500)
        try:
            with pytest.raises(astage.PersistError, match="open failed"):
                await write_checkpoint_file(path, encoded(2))
        finally:
            directory.chmod(0o700)
        assert files(directory) == [path.name]
        assert same(state(1), await load_checkpoint_file(path))
        return
    # chmod does not stop root: make the filesystem itself read-only instead.
    with tmpfs(tmp_path / "ro", "4m") as mnt:
        path = mnt / "r.astage"
        await write_checkpoint_file(path, encoded(1))
        remount_read_only(mnt)
        with pytest.raises(astage.PersistError, match="open failed") as info:
            await write_checkpoint_file(path, encoded(2))
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == errno.EROFS
        assert files(mnt) == [path.name]
        assert same(state(1), await load_checkpoint_file(path))


# -- crash safety -------------------------------------------------------------------------


async def _write_forever(path: Path, replicas: tuple[Encoded, Encoded]) -> None:
    for i in range(1_000_000):
        await write_checkpoint_file(path, replicas[i % 2], chunk_nbytes=32 << 10)


def test_sigkill_at_random_points_leaves_the_old_or_the_new_replica(tmp_path: Path) -> None:
    path = tmp_path / "r.astage"
    a, b = encoded(1, nbytes=1 << 20), encoded(2, nbytes=2 << 20)
    versions = {b"".join(a.buffers()), b"".join(b.buffers())}
    anyio.run(write_checkpoint_file, path, a)
    rng = random.Random(1234)
    kills = 12 * int(os.environ.get("ASTAGE_SOAK_SCALE", "1"))
    for _ in range(kills):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads, 3.12+
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns into pytest
            try:
                anyio.run(_write_forever, path, (b, a))
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.0, 0.08))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert path.read_bytes() in versions
        load_checkpoint_file_sync(path)
        sweep_stale_temps(tmp_path)
        assert files(tmp_path) == [path.name]


# -- sweeping and finding -----------------------------------------------------------------


def test_sweep_removes_only_astage_temps(tmp_path: Path) -> None:
    final = tmp_path / "replica-owner00000-holder00001.astage"
    ours = [temp_path_for(final), temp_path_for(tmp_path / "other.bin")]
    hex32 = uuid.uuid4().hex
    keep = [
        final.name,
        "notes.txt",
        f"x.astage-tmp.{hex32}",  # no leading dot
        f".x.astage-tmp.{hex32[:31]}",  # short id
        f".x.astage-tmp.{hex32.upper()}",  # not our hex
        f".x.astage-tmp.{hex32}.bak",
        f".x.astage-tmp.{hex32}\n",
    ]
    for p in ours:
        p.write_bytes(b"partial")
    for name in keep:
        (tmp_path / name).write_bytes(b"keep")
    (tmp_path / f".dir.astage-tmp.{uuid.uuid4().hex}").mkdir()
    link = tmp_path / f".link.astage-tmp.{uuid.uuid4().hex}"
    link.symlink_to(tmp_path / "notes.txt")
    assert all(is_temp_name(p.name) for p in ours)
    assert not any(is_temp_name(n) for n in keep)
    assert sorted(sweep_stale_temps(tmp_path)) == sorted(ours)
    assert files(tmp_path) == sorted([*keep, link.name, next(tmp_path.glob(".dir.*")).name])
    assert sweep_stale_temps(tmp_path / "missing") == []


def test_sweep_can_spare_recent_temps(tmp_path: Path) -> None:
    old, fresh = temp_path_for(tmp_path / "a.astage"), temp_path_for(tmp_path / "b.astage")
    old.write_bytes(b"")
    fresh.write_bytes(b"")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    assert sweep_stale_temps(tmp_path, older_than=60) == [old]
    assert files(tmp_path) == [fresh.name]


@pytest.mark.anyio
async def test_find_replicas_lists_valid_ones_newest_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = []
    for i, (owner, holder) in enumerate([(0, 1), (1, 2), (2, 0)]):
        path = replica_path(tmp_path, owner_rank=owner, holder_rank=holder)
        await write_checkpoint_file(path, encoded(10 + i, owner=owner, holder=holder))
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
        paths.append(path)
    os.utime(paths[0], (2_000_000, 2_000_000))
    (tmp_path / "corrupt.astage").write_bytes(b"ASTAGE\x00R garbage")
    temp_path_for(paths[0]).write_bytes(paths[0].read_bytes())
    (tmp_path / "notes.txt").write_text("not a replica")
    with caplog.at_level(logging.WARNING, logger="astage.persist"):
        found = await anyio.to_thread.run_sync(find_replicas, tmp_path)
    assert [r.path for r in found] == [paths[0], paths[2], paths[1]]
    first = found[0]
    assert (first.owner_rank, first.holder_rank, first.step, first.checkpoint_id) == (0, 1, 10, "c10")
    assert first.nbytes == paths[0].stat().st_size
    assert first.mtime == 2_000_000
    assert first.header.num_tensors == 3
    assert "corrupt.astage" in caplog.text
    assert await anyio.to_thread.run_sync(find_replicas, tmp_path / "missing") == []


# -- loading damaged files ----------------------------------------------------------------


def _damaged(data: bytes) -> dict[str, bytes]:
    prefix = encoded(1).header.prefix_nbytes
    flipped = bytearray(data)
    flipped[-1] ^= 0x10
    return {
        "empty": b"",
        "cut in the fixed part": data[:10],
        "cut in the header": data[: prefix // 2],
        "cut at the body": data[:prefix],
        "cut in the body": data[:-1],
        "trailing bytes": data + b"\x00",
        "flipped body bit": bytes(flipped),
        "not a replica": b"PK\x03\x04" + data[4:],
    }


@pytest.mark.anyio
async def test_damaged_files_raise_integrity_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.astage"
    await write_checkpoint_file(good, encoded(1))
    data = good.read_bytes()
    for name, content in _damaged(data).items():
        path = tmp_path / f"{name.replace(' ', '-')}.astage"
        path.write_bytes(content)
        with pytest.raises(astage.IntegrityError, match=str(path)):
            await load_checkpoint_file(path)
        with pytest.raises(astage.IntegrityError):
            load_checkpoint_file_sync(path)
    # Listing reads prefixes only: a damaged body shows only when loading.
    found = await anyio.to_thread.run_sync(find_replicas, tmp_path)
    assert {r.path.name for r in found} == {"good.astage", "flipped-body-bit.astage"}


@pytest.mark.anyio
async def test_a_header_claiming_a_huge_body_is_refused_before_allocating(tmp_path: Path) -> None:
    replica = encoded(1)
    header = replica.prefix[20 : 20 + struct.unpack_from("<Q", replica.prefix, 12)[0]]
    tensors, dims, storages, structure_len = struct.unpack_from("<QQQQ", header)
    values_at = 32 + 16 * tensors + 8 * dims + 24 * storages + structure_len
    doc = json.loads(header[values_at:])  # the values document, after the structure's
    doc["body_nbytes"] = 1 << 50
    last_offset = struct.unpack_from("<Q", header, values_at - structure_len - 24)[0]
    last = struct.pack("<QQII", last_offset, (1 << 50) - last_offset, 0, 0)
    header = header[: values_at - structure_len - 24] + last + header[values_at - structure_len : values_at]
    header += json.dumps(doc).encode()
    head = _format.MAGIC + struct.pack("<IQ", _format.FORMAT_VERSION, len(header)) + header
    head += struct.pack("<I", crc32c.crc32c(head))
    prefix = head + bytes(-len(head) % _format.ALIGNMENT)
    assert _format.parse_prefix(prefix).body_nbytes == 1 << 50
    path = tmp_path / "huge.astage"
    path.write_bytes(prefix + bytes(64))
    # Allocating 1 PiB would fail with a RuntimeError: the size check comes first.
    with pytest.raises(astage.IntegrityError, match="header says"):
        await load_checkpoint_file(path)


@pytest.mark.anyio
async def test_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await load_checkpoint_file(tmp_path / "nope.astage")


# -- the blocking-I/O helper --------------------------------------------------------------------


@pytest.mark.anyio
async def test_blocking_io_honours_its_limiter_on_every_backend() -> None:
    """With one token, a second blocking call waits on the loop until the first returns.

    Under asyncio the helper used to go through aiofiles' executor wrapper and ignore the
    limiter, so ``Checkpointer(threads=...)`` did not bound file I/O there.
    """
    limiter = anyio.CapacityLimiter(1)
    entered = threading.Event()
    release = threading.Event()
    lock = threading.Lock()
    running = peak = 0

    def call() -> None:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        entered.set()
        release.wait(10)  # the test releases it; the timeout only ends a broken run
        with lock:
            running -= 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(blocking_io, call, limiter=limiter))
        tg.start_soon(functools.partial(blocking_io, call, limiter=limiter))
        await anyio.to_thread.run_sync(entered.wait, 10)
        await anyio.wait_all_tasks_blocked()
        waiting = limiter.statistics().tasks_waiting
        release.set()
    assert waiting == 1, "the second call did not wait for the limiter's one token"
    assert peak == 1
    assert limiter.borrowed_tokens == 0


def _write_calls() -> int:
    """Write system calls this process has made so far (Linux ``/proc/self/io``)."""
    try:
        text = Path("/proc/self/io").read_text()
    except OSError:
        pytest.skip("/proc/self/io is not readable here")
    return int(re.search(r"^syscw: (\d+)$", text, re.MULTILINE).group(1))  # type: ignore[union-attr]


def test_many_small_buffers_are_written_in_few_system_calls(tmp_path: Path) -> None:
    # On main each buffer was one write(): 20,000 small storages made 40,000 calls.
    pieces = [bytes([i % 251]) * (1 + i % 7) for i in range(5000)]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        before = _write_calls()
        written = _persist._write_all(fd, [memoryview(p) for p in pieces], 0)
        calls = _write_calls() - before
    finally:
        os.close(fd)
    assert written == sum(map(len, pieces))
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)
    assert calls <= 10, calls
