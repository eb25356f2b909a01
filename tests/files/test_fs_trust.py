"""Trusting the file system as little as an adversary would: real files, links, FIFOs, ranks.

* Ranks sharing one directory: another rank's housekeeping (start-up, retention) may remove
  a step directory while it is empty; no save may fail because of it.
* A commit stands once its marker is durable: a retention failure after it is a warning.
* Links planted anywhere under the directory are never followed: nothing outside it is
  created, written or deleted (:data:`OUTSIDE` is checked byte for byte after each case).
* FIFOs, sockets, directories and devices where a file is expected are refused at once.
* Commit markers are untrusted input: checksummed, naming only astage's own file.
* Directories astage creates are 0700 whatever the umask.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import astage
from astage._files.durable import CheckpointFileWriter, replica_path, write_checkpoint_file
from astage._files.markers import FileEntry, Marker, marker_crc32c, parse_marker
from astage._format.codec import encode
from astage._replication.replicas import read_replica_file as _read_replica_file
from tests.distributed import run_group
from tests.helpers import no_blocking_calls_on_the_loop, until  # noqa: F401 - autouse fixture

SCALE = int(os.environ.get("ASTAGE_SOAK_SCALE", "1"))

pytestmark = pytest.mark.anyio


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((256,), float(step)), "step": step}


# -- ranks sharing one directory ------------------------------------------------------------


SHARED_SAVES = 100 * SCALE


async def sharing_rank_target(rank: int, world: int, root: str) -> list[str]:
    """Save ``SHARED_SAVES`` steps with ``keep=1`` in the directory all ranks share."""
    failures = []
    async with astage.Checkpointer(root, rank=rank, keep=1) as ckpt:
        sizes = random.Random(rank)
        for step in range(SHARED_SAVES):
            # Sizes vary so that the ranks drift ahead of and behind each other, again and
            # again: a rank's retention then meets another's first write in a step directory.
            padding = torch.zeros(sizes.choice([16, 4 << 10, 64 << 10]))
            try:
                await (await ckpt.save(step, {**state(step), "padding": padding})).wait()
            except astage.PersistError as exc:
                failures.append(f"rank {rank} step {step}: {exc}")
        if ckpt.steps() != [SHARED_SAVES - 1]:
            failures.append(f"rank {rank} ends with the steps {ckpt.steps()}")
    return failures


def test_ranks_sharing_a_directory_with_keep_1_never_lose_a_save(tmp_path: Path) -> None:
    """Three processes, one directory, each rank's retention removing emptied step directories
    while the others create theirs: on main a few saves in a few hundred failed (ENOENT)."""
    failures = [f for result in run_group(3, sharing_rank_target, str(tmp_path)) for f in result.unwrap()]
    assert not failures, f"{len(failures)} of {3 * SHARED_SAVES} saves failed: {failures[:3]}"
    for rank in range(3):
        restored = anyio.run(restore_latest, tmp_path, rank)
        assert torch.equal(restored["w"], state(SHARED_SAVES - 1)["w"])


async def restore_latest(directory: Path, rank: int) -> Any:
    async with astage.Checkpointer(directory, rank=rank) as ckpt:
        return await ckpt.restore()


_RACER = """
import os, sys
names, stop = sys.argv[1:-1], sys.argv[-1]
log = open(stop + ".removed", "w", buffering=1)
open(stop + ".ready", "w").close()
left = {name: 3 for name in names}  # each step directory removed three times, as soon as empty
while left and not os.path.exists(stop):
    for name in list(left):
        try:
            os.rmdir(name)
        except OSError:
            continue
        log.write(name + "\\n")
        left[name] -= 1
        if not left[name]:
            del left[name]
"""


async def test_a_step_directory_removed_while_empty_never_fails_the_save(tmp_path: Path) -> None:
    """A competing process removes each step directory as soon as it exists and is empty
    (three times at most), as another rank's retention or start-up may: it hits the window
    between creating a step directory and creating a file in it.  Saves go on until it has
    hit a few times (on a loaded machine it may miss some).
    """
    names = [str(tmp_path / f"step_{s:010d}") for s in range(200)]
    stop = tmp_path.parent / f"{tmp_path.name}.stop"
    removed = Path(f"{stop}.removed")
    racer = await anyio.open_process([sys.executable, "-c", _RACER, *names, str(stop)])
    try:
        await until(lambda: Path(f"{stop}.ready").exists())
        async with astage.Checkpointer(tmp_path, keep=2) as ckpt:
            for step in range(len(names)):
                await (await ckpt.save(step, state(step))).wait()
                if lines(removed) >= 5:
                    break
            assert ckpt.steps() == [step - 1, step]
    finally:
        await anyio.Path(stop).touch()
        with anyio.fail_after(30):
            await racer.wait()
    assert lines(removed), "the racer removed nothing: the test proves nothing"


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


# -- a commit stands once its marker is durable ----------------------------------------------


def chattr(flag: str, path: Path) -> None:
    done = subprocess.run(["chattr", flag, str(path)], capture_output=True, check=False)
    if done.returncode:
        pytest.skip(f"chattr {flag} is not available here: {done.stderr.decode().strip()}")


async def test_a_retention_failure_after_the_commit_is_one_warning_not_a_failed_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with astage.Checkpointer(tmp_path, keep=1) as ckpt:
        await (await ckpt.save(1, state(1))).wait()
        marker = ckpt.step_dir(1) / "rank00000.COMMITTED"
        chattr("+i", marker)  # root ignores permissions, not the immutable flag
        try:
            with caplog.at_level(logging.WARNING, logger="astage.checkpointer"):
                for step in (2, 3):
                    stats = await (await ckpt.save(step, state(step))).wait()
                    assert stats.step == step
                await ckpt.wait()
            assert ckpt.steps() == [1, 3], "the undeletable step stays committed, the others go"
            assert ckpt.latest() == 3
            assert torch.equal((await ckpt.restore(1))["w"], state(1)["w"])
        finally:
            chattr("-i", marker)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "step 1, which stays committed" in warnings[0].getMessage()


async def test_an_old_step_that_cannot_be_retired_never_fails_the_new_save(tmp_path: Path) -> None:
    """On main, retention raised ``ValueError`` on a file name with a NUL byte taken from an
    old marker, and the save just committed was reported as failed."""
    step_dir = tmp_path / "step_0000000001"
    step_dir.mkdir(mode=0o700)
    (step_dir / "rank00000.astage").write_bytes(b"x")
    (step_dir / "rank00000.COMMITTED").write_text(json.dumps(v1_marker(1, name="rank00000.astage\0")))
    async with astage.Checkpointer(tmp_path, keep=1) as ckpt:
        stats = await (await ckpt.save(2, state(2))).wait()
        assert stats.step == 2
        await ckpt.wait()
        assert ckpt.latest() == 2


def v1_marker(step: int, *, name: str = "rank00000.astage", rank: int = 0) -> dict[str, Any]:
    """A commit marker as astage 0.1 wrote it (version 1, no checksum)."""
    return {
        "format": "astage-checkpoint",
        "version": 1,
        "step": step,
        "rank": rank,
        "checkpoint_id": "0" * 32,
        "created": 1.5,
        "files": [{"name": name, "nbytes": 1, "storages_crc32c": 0}],
    }


# -- links planted under the directory are never followed ------------------------------------


class Outside:
    """A directory outside the checkpoint directory, with a file that must stay untouched."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "outside"
        self.dir.mkdir()
        self.victim = self.dir / "victim"
        self.victim.write_bytes(b"precious")
        self.before = self.snapshot()

    def snapshot(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(self.dir.iterdir()) if p.is_file()}

    def check(self) -> None:
        assert self.snapshot() == self.before, "a file outside the directory was created, changed or deleted"


@pytest.fixture
def outside(tmp_path: Path) -> Outside:
    return Outside(tmp_path)


async def test_a_step_directory_planted_as_a_link_is_refused_not_written_through(
    tmp_path: Path, outside: Outside
) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "step_0000000001").symlink_to(outside.dir)
    async with astage.Checkpointer(directory) as ckpt:
        handle = await ckpt.save(1, state(1))
        with pytest.raises(astage.PersistError, match="symbolic link"):
            await handle.wait()
        assert ckpt.steps() == []
        await (await ckpt.save(2, state(2))).wait()
    outside.check()
    assert (directory / "step_0000000001").is_symlink()


async def test_retention_never_deletes_through_a_step_directory_replaced_by_a_link(
    tmp_path: Path, outside: Outside
) -> None:
    directory = tmp_path / "ckpt"
    async with astage.Checkpointer(directory, keep=1) as ckpt:
        await (await ckpt.save(1, state(1))).wait()
        step_dir = ckpt.step_dir(1)
        for name in ("rank00000.astage", "rank00000.COMMITTED"):
            (outside.dir / name).write_bytes((step_dir / name).read_bytes())
            (step_dir / name).unlink()
        outside.before = outside.snapshot()
        step_dir.rmdir()
        step_dir.symlink_to(outside.dir)
        await (await ckpt.save(2, state(2))).wait()
        assert ckpt.latest() == 2
    outside.check()


async def test_a_commit_marker_planted_as_a_link_is_not_followed(tmp_path: Path, outside: Outside) -> None:
    directory = tmp_path / "ckpt"
    async with astage.Checkpointer(directory, keep=None) as ckpt:
        await (await ckpt.save(1, state(1))).wait()
    marker = directory / "step_0000000001" / "rank00000.COMMITTED"
    (outside.dir / marker.name).write_bytes(marker.read_bytes())
    outside.before = outside.snapshot()
    marker.unlink()
    marker.symlink_to(outside.dir / marker.name)
    async with astage.Checkpointer(directory, keep=1) as ckpt:
        assert ckpt.steps() == [], "a marker reached through a link commits nothing"
        await (await ckpt.save(2, state(2))).wait()
    outside.check()


async def test_a_lock_file_planted_as_a_link_is_refused(tmp_path: Path, outside: Outside) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / ".astage-rank00000.lock").symlink_to(outside.dir / "lock")
    with pytest.raises(astage.PersistError, match="symbolic link"):
        async with astage.Checkpointer(directory):
            pass
    (directory / ".astage-rank00001.lock").symlink_to(outside.victim)
    with pytest.raises(astage.PersistError, match="symbolic link"):
        async with astage.Checkpointer(directory, rank=1):
            pass
    outside.check()


async def test_a_data_file_or_temp_name_planted_as_a_link_is_replaced_or_refused(
    tmp_path: Path, outside: Outside
) -> None:
    directory = tmp_path / "ckpt"
    step_dir = directory / "step_0000000001"
    step_dir.mkdir(parents=True)
    (step_dir / "rank00000.astage").symlink_to(outside.victim)
    async with astage.Checkpointer(directory) as ckpt:  # the uncommitted "file" is swept: the link
        await (await ckpt.save(1, state(1))).wait()
        assert torch.equal((await ckpt.restore(1))["w"], state(1)["w"])
    assert not (step_dir / "rank00000.astage").is_symlink()

    final = tmp_path / "replicas" / "r.astage"
    final.parent.mkdir()
    final.symlink_to(outside.victim)
    writer = CheckpointFileWriter(final)
    writer.temp_path.symlink_to(outside.dir / "created-through-the-temp")
    with pytest.raises(astage.PersistError, match="open failed"):
        await writer.open()
    writer.temp_path.unlink()
    await write_checkpoint_file(final, encode(state(3), owner_rank=0, step=3, checkpoint_id="c"))
    assert not final.is_symlink()
    assert astage.load_checkpoint_file_sync(final)["step"] == 3
    outside.check()


def test_a_held_replica_planted_as_a_link_is_never_sent_back(tmp_path: Path, outside: Outside) -> None:
    valid = outside.dir / "valid.astage"
    anyio.run(write_checkpoint_file, valid, encode(state(1), owner_rank=1, step=1, checkpoint_id="c"))
    outside.before = outside.snapshot()
    held = replica_path(tmp_path, owner_rank=1, holder_rank=0)
    held.symlink_to(valid)
    assert _read_replica_file(held) is None
    with pytest.raises(astage.IntegrityError, match="symbolic link"):
        astage.load_checkpoint_file_sync(held)
    assert astage.find_replicas(tmp_path) == []
    outside.check()


# -- FIFOs, sockets, directories and devices where a file is expected -------------------------


class FifoGuard:
    """Opens a FIFO's write end if a reader is still blocked on it after ``seconds``.

    Lets a test of a loader that would block for ever fail instead of hanging the run.
    """

    def __init__(self, fifo: Path, seconds: float = 10.0) -> None:
        self.fifo = fifo
        self.seconds = seconds
        self.released = threading.Event()
        self.had_to_unblock = False
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        if not self.released.wait(self.seconds):
            self.had_to_unblock = True
            with contextlib.suppress(OSError):
                os.close(os.open(self.fifo, os.O_WRONLY | os.O_NONBLOCK))

    def __enter__(self) -> FifoGuard:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        self.thread.join()
        assert not self.had_to_unblock, f"a reader blocked on the FIFO {self.fifo}"


def special_files(directory: Path) -> dict[str, Path]:
    """A FIFO, a directory, a socket and a link to a character device, all named ``*.astage``."""
    paths = {kind: directory / f"{kind}.astage" for kind in ("fifo", "directory", "socket", "device")}
    os.mkfifo(paths["fifo"])
    paths["directory"].mkdir()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(paths["socket"]))
    paths["device"].symlink_to("/dev/zero")
    return paths


async def test_loaders_refuse_fifos_sockets_directories_and_devices_at_once(tmp_path: Path) -> None:
    paths = special_files(tmp_path)
    with FifoGuard(paths["fifo"]):
        for kind, path in paths.items():
            for load in (
                astage.load_checkpoint_file_sync,
                astage.inspect_checkpoint_file,
                _read_replica_file,
            ):
                if load is _read_replica_file:
                    assert await anyio.to_thread.run_sync(load, path) is None, kind
                    continue
                with pytest.raises(astage.IntegrityError, match="not a file astage wrote"):
                    await anyio.to_thread.run_sync(load, path)
            with pytest.raises(astage.IntegrityError, match="not a file astage wrote"):
                await astage.load_checkpoint_file(path)
        assert await anyio.to_thread.run_sync(astage.find_replicas, tmp_path) == []
        assert await anyio.to_thread.run_sync(astage.sweep_stale_temps, tmp_path) == []


async def test_a_commit_marker_data_file_or_lock_that_is_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    async with astage.Checkpointer(tmp_path, keep=None) as ckpt:
        await (await ckpt.save(1, state(1))).wait()
    marker = tmp_path / "step_0000000001" / "rank00000.COMMITTED"
    marker.unlink()
    os.mkfifo(marker)
    with FifoGuard(marker):
        async with astage.Checkpointer(tmp_path, keep=None) as ckpt:
            assert ckpt.steps() == []
            with pytest.raises(astage.ResourceError):
                await ckpt.restore(1)
    data = tmp_path / "step_0000000002" / "rank00000.astage"
    async with astage.Checkpointer(tmp_path, keep=None) as ckpt:
        await (await ckpt.save(2, state(2))).wait()
        data.unlink()
        os.mkfifo(data)
        with FifoGuard(data), pytest.raises(astage.IntegrityError, match="FIFO"):
            await ckpt.restore(2)
    lock = tmp_path / ".astage-rank00002.lock"
    os.mkfifo(lock)
    with FifoGuard(lock), pytest.raises(astage.PersistError, match="FIFO"):
        async with astage.Checkpointer(tmp_path, rank=2):
            pass


# -- commit markers are untrusted input ----------------------------------------------------------

GOOD = Marker(5, 3, "ab" * 16, 1.25, (FileEntry("rank00003.astage", 1000, 7),))
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
FUZZ = settings(
    max_examples=int(os.environ.get("ASTAGE_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def rechecksummed(doc: dict[str, Any]) -> bytes:
    """``doc`` with a valid checksum, so that the damage reaches the deeper checks."""
    body = {k: v for k, v in doc.items() if k != "crc32c"}
    return json.dumps({**body, "crc32c": marker_crc32c(body)}).encode()


def parsed_or_refused(data: bytes) -> Marker | None:
    """What the parser makes of ``data``: the marker, or ``None`` for an IntegrityError."""
    try:
        return parse_marker(data, step=5, rank=3)
    except astage.IntegrityError:
        return None


@FUZZ
@given(st.data())
def test_a_damaged_marker_is_refused_or_reads_as_the_original(data: st.DataObject) -> None:
    raw = bytearray(GOOD.to_json())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw) - 1))
        edit = data.draw(st.sampled_from(["flip", "delete", "insert"]))
        if edit == "flip":
            raw[at] ^= 1 << data.draw(st.integers(0, 7))
        elif edit == "delete":
            del raw[at]
        else:
            raw[at:at] = data.draw(st.binary(min_size=1, max_size=4))
    assert parsed_or_refused(bytes(raw)) in (None, GOOD)


@FUZZ
@given(st.data())
def test_a_rechecksummed_marker_with_a_field_changed_is_refused_or_read_as_is(data: st.DataObject) -> None:
    doc = json.loads(GOOD.to_json())
    target = doc if data.draw(st.booleans()) else doc["files"][0]
    key = data.draw(st.sampled_from(sorted(set(target) - {"crc32c"})) | st.text(max_size=8))
    if key == "crc32c":  # recomputed below: the byte-level fuzz covers a wrong checksum
        return
    value = data.draw(JSON | st.text().map(lambda t: f"rank00003.astage{t}"))
    if key in target and type(value) is type(target[key]) and value == target[key]:
        return
    target[key] = value
    marker = parsed_or_refused(rechecksummed(doc))
    # Refused, or a valid marker that says exactly what the document says (a new size, say).
    assert marker is None or json.loads(marker.to_json()) == json.loads(rechecksummed(doc))
    if marker is not None:
        assert marker.files[0].name == "rank00003.astage"


@pytest.mark.parametrize(
    "name",
    ["rank00003.astage\0", "../rank00003.astage", "rank00004.astage", "rank00003.COMMITTED", "\ud800", ""],
)
def test_a_marker_naming_anything_but_this_ranks_data_file_is_refused(name: str) -> None:
    doc = json.loads(GOOD.to_json())
    doc["files"][0]["name"] = name
    with pytest.raises(astage.IntegrityError, match="names the file"):
        parse_marker(rechecksummed(doc), step=5, rank=3)
    assert parsed_or_refused(GOOD.to_json()) == GOOD


async def test_a_marker_naming_a_file_with_a_nul_byte_never_escapes_as_a_raw_error(tmp_path: Path) -> None:
    step_dir = tmp_path / "step_0000000001"
    step_dir.mkdir(mode=0o700)
    (step_dir / "rank00000.COMMITTED").write_text(json.dumps(v1_marker(1, name="rank00000.astage\0")))
    async with astage.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(astage.AstageError):
            await ckpt.restore(1)
        assert ckpt.steps() == []


# -- directories astage creates are 0700 whatever the umask ------------------------------------


def modes(root: Path, top: Path) -> dict[str, str]:
    """The permission bits of ``top`` and every directory from ``root`` down to it."""
    chain = [top, *[p for p in top.parents if root in p.parents]]
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.stat().st_mode)) for p in chain}


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


async def replication_dirs_target(rank: int, world: int, root: str) -> dict[str, str]:
    storage = Path(root) / f"rank{rank}" / "a" / "b"
    with umask(0):
        async with astage.ReplicationStager(storage_dir=storage, timeout=30):
            pass
    return modes(Path(root), storage)


def test_replication_storage_parents_are_0700_under_umask_0(tmp_path: Path) -> None:
    for result in run_group(2, replication_dirs_target, str(tmp_path)):
        assert set(result.unwrap().values()) == {"0o700"}, result.unwrap()


async def test_checkpoint_and_replica_directories_are_0700_under_umask_0(tmp_path: Path) -> None:
    with umask(0):
        async with astage.Checkpointer(tmp_path / "c" / "d") as ckpt:
            await (await ckpt.save(1, state(1))).wait()
        replica = encode(state(1), owner_rank=0, step=1, checkpoint_id="c")
        await write_checkpoint_file(tmp_path / "r" / "s" / "x.astage", replica)
    assert set(modes(tmp_path, ckpt.step_dir(1)).values()) == {"0o700"}
    assert set(modes(tmp_path, tmp_path / "r" / "s").values()) == {"0o700"}


async def test_restore_never_reads_through_a_step_directory_replaced_by_a_link(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    async with astage.Checkpointer(directory, keep=None) as ckpt:
        await (await ckpt.save(1, state(1))).wait()
        await (await ckpt.save(2, state(2))).wait()
        step_dir = ckpt.step_dir(1)
        moved = tmp_path / "moved"
        step_dir.rename(moved)
        step_dir.symlink_to(moved)
        with pytest.raises(astage.IntegrityError, match="symbolic link"):
            await ckpt.restore(1)
        assert torch.equal((await ckpt.restore(2))["w"], state(2)["w"])
