"""The remote tier against a real S3 server (SeaweedFS on 127.0.0.1) and memory:// / file:// stores:
uploads in the background, commit objects last, restore from the store alone, healing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import obstore
import pytest
import torch

import astage
from astage._remote.layout import commit_key, data_key
from tests.s3server import READONLY_KEY, READONLY_SECRET, SeaweedS3

pytestmark = pytest.mark.anyio


def s3_remote(server: SeaweedS3, bucket: str, prefix: str = "run", **kwargs: Any) -> astage.Remote:
    """A Remote on ``bucket`` of the test server."""
    return astage.Remote(
        f"s3://{bucket}/{prefix}",
        options=server.options(),
        client_options={"allow_http": True},
        chunk_nbytes=5 << 20,
        **kwargs,
    )


def state(step: int, n: int = 1000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "b": torch.arange(n) * step, "step": step}


def assert_state(got: dict[str, Any], step: int, n: int = 1000) -> None:
    want = state(step, n)
    assert got["step"] == step
    assert torch.equal(got["w"], want["w"])
    assert torch.equal(got["b"], want["b"])


async def test_memory_store_round_trip(tmp_path: Path) -> None:
    remote = astage.Remote("memory:///")
    async with astage.Checkpointer(tmp_path / "a", remote=remote, keep=1) as ckpt:
        for step in (1, 2, 3):
            handle = await ckpt.save(step, state(step))
            stats = await handle.uploaded()
            assert stats is not None
            assert stats.step == step
            assert stats.nbytes == handle.stats.nbytes
            assert stats.seconds > 0
            assert stats.gbps > 0
        assert ckpt.steps() == [3]
    # A fresh machine: an empty directory, the same store.
    async with astage.Checkpointer(tmp_path / "fresh", remote=remote) as ckpt:
        assert ckpt.steps() == []
        assert_state(await ckpt.restore(), 3)
        assert ckpt.steps() == [3]  # healed: committed locally
        assert_state(await ckpt.restore(step=1), 1)  # only on the store
    async with astage.Checkpointer(tmp_path / "fresh") as ckpt:  # the healed copy stands alone
        assert ckpt.steps() == [1, 3]
        assert_state(await ckpt.restore(step=1), 1)


async def test_s3_upload_commit_last_and_restore_from_store_alone(
    s3_server: SeaweedS3, tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket()
    remote = s3_remote(s3_server, bucket)
    async with astage.Checkpointer(tmp_path / "a", remote=remote, keep=2) as ckpt:
        for step in range(4):
            await ckpt.save(step, state(step, 3_000_000))  # 36 MB: multipart
        stats = await ckpt.wait_uploaded(3)
        assert stats is not None
        assert stats.nbytes > 5 << 20
    store = remote.client().store
    keys = sorted(m["path"] for m in obstore.list(store).collect())
    assert keys == sorted([data_key(s, 0) for s in range(4)] + [commit_key(s, 0) for s in range(4)])
    commit = json.loads(bytes(obstore.get(store, commit_key(3, 0)).bytes()))
    assert commit["object"]["nbytes"] == stats.nbytes
    assert commit["world_size"] == 1
    async with astage.Checkpointer(tmp_path / "fresh", remote=s3_remote(s3_server, bucket)) as ckpt:
        assert_state(await ckpt.restore(), 3, 3_000_000)
        assert_state(await ckpt.restore(step=0), 0, 3_000_000)


async def test_file_store_and_every_nth_commit(tmp_path: Path) -> None:
    url = (tmp_path / "store").as_uri()
    remote = astage.Remote(url, every=2)
    async with astage.Checkpointer(tmp_path / "a", remote=remote, keep=None) as ckpt:
        handles = [await ckpt.save(step, state(step)) for step in range(5)]
        uploaded = [await h.uploaded() for h in handles]
    assert [u is not None for u in uploaded] == [True, False, True, False, True]
    async with astage.Checkpointer(tmp_path / "fresh", remote=astage.Remote(url)) as ckpt:
        assert_state(await ckpt.restore(), 4)
        with pytest.raises(astage.ResourceError):
            await ckpt.restore(step=3)


async def test_corrupt_object_on_the_store_is_never_restored(tmp_path: Path) -> None:
    remote = astage.Remote("memory:///")
    async with astage.Checkpointer(tmp_path / "a", remote=remote, keep=None) as ckpt:
        for step in (1, 2):
            await (await ckpt.save(step, state(step))).uploaded()
    store = remote.client().store
    data = bytearray(bytes(obstore.get(store, data_key(2, 0)).bytes()))
    data[len(data) // 2] ^= 0xFF
    obstore.put(store, data_key(2, 0), bytes(data))
    async with astage.Checkpointer(tmp_path / "fresh", remote=remote) as ckpt:
        assert_state(await ckpt.restore(), 1)  # the older step, not the corrupt one
        assert ckpt.steps() == [1]
        with pytest.raises(astage.IntegrityError):
            await ckpt.restore(step=2)
    obstore.put(store, data_key(1, 0), bytes(data[:100]))  # truncated
    async with astage.Checkpointer(tmp_path / "fresh2", remote=remote) as ckpt:
        with pytest.raises(astage.IntegrityError):
            await ckpt.restore()
        assert ckpt.steps() == []


async def test_a_fresh_machine_restores_from_the_store_into_its_own_tensors(tmp_path: Path) -> None:
    remote = astage.Remote("memory:///")
    async with astage.Checkpointer(tmp_path / "a", remote=remote) as ckpt:
        for step in (1, 2):
            await (await ckpt.save(step, state(step))).uploaded()
    model = {"w": torch.zeros(1000), "b": torch.zeros(1000, dtype=torch.int64), "step": 0}
    w, b = model["w"], model["b"]
    async with astage.Checkpointer(tmp_path / "fresh", remote=remote) as ckpt:
        got = await ckpt.restore(into=model)
        assert got["w"] is w  # the caller's own tensors, filled in place
        assert got["b"] is b
        assert_state(got, 2)
        assert ckpt.steps() == [2]  # healed from the store, then read into the tensors
        got = await ckpt.restore(step=1, into=model)  # a step only the store has
        assert got["w"] is w
        assert_state(got, 1)


async def test_a_corrupt_store_copy_leaves_the_destination_untouched_and_says_so(tmp_path: Path) -> None:
    remote = astage.Remote("memory:///")
    async with astage.Checkpointer(tmp_path / "a", remote=remote) as ckpt:
        await (await ckpt.save(1, state(1))).uploaded()
    store = remote.client().store
    data = bytearray(bytes(obstore.get(store, data_key(1, 0)).bytes()))
    data[len(data) // 2] ^= 0xFF
    obstore.put(store, data_key(1, 0), bytes(data))
    model = {"w": torch.full((1000,), 7.0), "b": torch.full((1000,), 7, dtype=torch.int64), "step": 0}
    async with astage.Checkpointer(tmp_path / "fresh", remote=remote) as ckpt:
        with pytest.raises(astage.IntegrityError) as info:
            await ckpt.restore(into=model)
    # The download is verified before it is committed locally: no byte reached the tensors.
    report = info.value.fill_report  # type: ignore[attr-defined]
    assert report.filled == ()
    assert report.partial == ()
    assert sorted(report.untouched) == [("b",), ("w",)]
    assert bool((model["w"] == 7.0).all())
    assert bool((model["b"] == 7).all())


async def test_wrong_credentials_and_missing_bucket_fail_at_once(
    s3_server: SeaweedS3, tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket()
    wrong = astage.Remote(
        f"s3://{bucket}/run",
        options=s3_server.options(secret_access_key="not-the-secret"),
        client_options={"allow_http": True},
    )
    with pytest.raises(astage.RemoteError, match="refused") as info:
        async with astage.Checkpointer(tmp_path / "a", remote=wrong):
            pass
    assert "not-the-secret" not in str(info.value)
    missing = astage.Remote(
        "s3://no-such-bucket-astage/run", options=s3_server.options(), client_options={"allow_http": True}
    )
    with pytest.raises(astage.RemoteError, match="no-such-bucket-astage"):
        async with astage.Checkpointer(tmp_path / "b", remote=missing):
            pass
    async with astage.Checkpointer(tmp_path / "b") as ckpt:  # the lock was released
        assert ckpt.steps() == []


async def test_local_retention_keeps_steps_waiting_for_upload(tmp_path: Path) -> None:
    remote = astage.Remote("memory:///", keep=astage.latest(2))
    async with astage.Checkpointer(tmp_path / "a", remote=remote, keep=1) as ckpt:
        for step in range(5):
            await ckpt.save(step, state(step))
        await ckpt.wait()
        await ckpt.wait_uploaded(4)
    store = remote.client().store
    keys = sorted(m["path"] for m in obstore.list(store).collect())
    assert keys == sorted([data_key(s, 0) for s in (3, 4)] + [commit_key(s, 0) for s in (3, 4)])


async def test_a_prefix_owned_by_another_run_is_refused(s3_server: SeaweedS3, tmp_path: Path) -> None:
    bucket = s3_server.new_bucket()
    async with astage.Checkpointer(tmp_path / "a", remote=s3_remote(s3_server, bucket, run="job-1")) as ckpt:
        await (await ckpt.save(1, state(1))).uploaded()
    with pytest.raises(astage.RemoteError, match="another run"):
        async with astage.Checkpointer(tmp_path / "b", remote=s3_remote(s3_server, bucket, run="job-2")):
            pass
    # The same run again (a restart) is welcome, and so is a reader that claims nothing.
    async with astage.Checkpointer(tmp_path / "c", remote=s3_remote(s3_server, bucket, run="job-1")) as ckpt:
        assert_state(await ckpt.restore(), 1)
    async with astage.Checkpointer(tmp_path / "d", remote=s3_remote(s3_server, bucket)) as ckpt:
        assert_state(await ckpt.restore(), 1)


async def test_progress_reports_the_upload_after_the_commit(tmp_path: Path) -> None:
    events: list[astage.SaveEvent] = []
    remote = astage.Remote("memory:///")
    async with astage.Checkpointer(tmp_path / "a", remote=remote, on_progress=events.append) as ckpt:
        stats = await (await ckpt.save(1, state(1))).uploaded()
        assert ckpt.last_upload_stats == stats
    kinds = [e.kind for e in events]
    assert kinds.index("committed") < kinds.index("uploaded")
    uploaded = events[kinds.index("uploaded")]
    assert uploaded.upload == stats
    assert uploaded.step == 1
    assert uploaded.elapsed_seconds >= stats.seconds


async def test_save_now_and_upload_uploads_a_step_the_interval_would_skip(tmp_path: Path) -> None:
    remote = astage.Remote("memory:///", every=100)
    async with astage.Checkpointer(tmp_path / "a", remote=remote) as ckpt:
        assert await (await ckpt.save(1, state(1))).uploaded() is not None  # the first is picked
        assert await (await ckpt.save(2, state(2))).uploaded() is None  # the interval skips it
        stats = await ckpt.save_now_and_upload(3, state(3), deadline=60)
        assert stats.step == 3
    async with astage.Checkpointer(tmp_path / "fresh", remote=remote) as ckpt:
        assert_state(await ckpt.restore(), 3)
    async with astage.Checkpointer(tmp_path / "plain") as ckpt:
        with pytest.raises(astage.ConfigurationError):
            await ckpt.save_now_and_upload(1, state(1), deadline=1)


def test_one_remote_serves_runs_on_either_backend(tmp_path: Path) -> None:
    remote = astage.Remote((tmp_path / "store").as_uri())

    async def save(step: int) -> None:
        async with astage.Checkpointer(tmp_path / f"a{step}", remote=remote) as ckpt:
            await (await ckpt.save(step, state(step))).uploaded()

    anyio.run(save, 1, backend="asyncio")
    anyio.run(save, 2, backend="trio")

    async def restore() -> Any:
        async with astage.Checkpointer(tmp_path / "fresh", remote=remote) as ckpt:
            return await ckpt.restore()

    assert_state(anyio.run(restore, backend="trio"), 2)
    assert_state(anyio.run(restore, backend="asyncio"), 2)


async def test_a_read_only_credential_fails_the_upload_without_retrying(
    s3_server: SeaweedS3, tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket()
    reader = astage.Remote(
        f"s3://{bucket}/run",
        options=s3_server.options(access_key_id=READONLY_KEY, secret_access_key=READONLY_SECRET),
        client_options={"allow_http": True},
        attempts=50,
    )
    async with astage.Checkpointer(tmp_path / "a", remote=reader) as ckpt:  # listing is allowed
        handle = await ckpt.save(1, state(1))
        with pytest.raises(astage.RemoteError, match="refused") as info:
            await handle.uploaded()
        assert READONLY_SECRET not in str(info.value)
        assert ckpt.steps() == [1]


async def test_a_tampered_commit_object_is_never_trusted(tmp_path: Path) -> None:
    remote = astage.Remote("memory:///")
    async with astage.Checkpointer(tmp_path / "a", remote=remote, keep=None) as ckpt:
        for step in (1, 2):
            await (await ckpt.save(step, state(step))).uploaded()
    store = remote.client().store
    commit = json.loads(bytes(obstore.get(store, commit_key(2, 0)).bytes()))
    commit["object"]["crc32c"] ^= 1  # its own checksum no longer matches
    obstore.put(store, commit_key(2, 0), json.dumps(commit).encode())
    async with astage.Checkpointer(tmp_path / "fresh", remote=remote) as ckpt:
        assert_state(await ckpt.restore(), 1)
        with pytest.raises(astage.IntegrityError, match="checksum"):
            await ckpt.restore(step=2)
