"""Faults on the way to the store: 503s, resets, a slow store, a store that stays down, the
server killed mid-upload and restarted, a rank SIGKILLed during its upload, hostile keys."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import obstore
import pytest

import astage
from astage._remote.layout import commit_key, data_key, group_listing, parse_key
from tests.distributed import kill_self, run_group
from tests.faultproxy import FaultProxy, fault_proxy
from tests.remote.test_remote_tier import assert_state, state
from tests.s3server import SeaweedS3

pytestmark = pytest.mark.anyio

_BIG = 4_000_000  # elements: a 48 MB checkpoint, ten 5 MiB parts


def proxied(server: SeaweedS3, proxy: FaultProxy, bucket: str, **kwargs: Any) -> astage.Remote:
    return astage.Remote(
        f"s3://{bucket}/run",
        options=server.options(endpoint=proxy.endpoint),
        client_options={"allow_http": True},
        chunk_nbytes=5 << 20,
        max_concurrency=2,
        **kwargs,
    )


async def test_503s_and_a_reset_mid_upload_are_retried(s3_server: SeaweedS3, tmp_path: Path) -> None:
    bucket = s3_server.new_bucket()
    with fault_proxy(s3_server.ports["s3"]) as proxy:
        remote = proxied(s3_server, proxy, bucket, attempts=8)
        async with astage.Checkpointer(tmp_path / "a", remote=remote) as ckpt:
            proxy.fail_connections = 3
            proxy.reset_after = 12 << 20
            stats = await (await ckpt.save(1, state(1, _BIG))).uploaded()
            assert stats is not None
            assert proxy.injected >= 2  # the 503s and the reset happened, and were survived
        async with astage.Checkpointer(tmp_path / "fresh", remote=proxied(s3_server, proxy, bucket)) as ckpt:
            proxy.delay = 0.001  # a slow store is only slower
            assert_state(await ckpt.restore(), 1, _BIG)


async def test_a_store_that_stays_down_fails_the_upload_not_the_save(
    s3_server: SeaweedS3, tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket()
    with fault_proxy(s3_server.ports["s3"]) as proxy:
        remote = proxied(s3_server, proxy, bucket, attempts=2, deadline=60.0)
        async with astage.Checkpointer(tmp_path / "a", remote=remote, keep=1) as ckpt:
            proxy.refuse = True
            handle = await ckpt.save(1, state(1))
            await handle.wait()  # committed locally all the same
            with pytest.raises(astage.RemoteError, match=r"step 1|run/step_0000000001"):
                await handle.uploaded()
            assert ckpt.steps() == [1]
            proxy.refuse = False
            await (await ckpt.save(2, state(2))).uploaded()
    store = astage.Remote(
        f"s3://{bucket}/run", options=s3_server.options(), client_options={"allow_http": True}
    ).client()
    keys = {m["path"] for m in obstore.list(store.store).collect()}
    assert commit_key(1, 0) not in keys  # never reported, never complete
    assert commit_key(2, 0) in keys


async def test_server_killed_mid_upload_and_restarted(s3_server: SeaweedS3, tmp_path: Path) -> None:
    bucket = s3_server.new_bucket()
    with fault_proxy(s3_server.ports["s3"]) as proxy:
        remote = proxied(s3_server, proxy, bucket, attempts=10)
        async with astage.Checkpointer(tmp_path / "a", remote=remote) as ckpt:
            handle = await ckpt.save(7, state(7, _BIG))
            await anyio.to_thread.run_sync(proxy.wait_uploaded, 10 << 20)
            s3_server.kill()
            await anyio.to_thread.run_sync(s3_server.start)
            stats = await handle.uploaded()
            assert stats is not None
            assert stats.attempts >= 1
    async with astage.Checkpointer(
        tmp_path / "fresh",
        remote=astage.Remote(
            f"s3://{bucket}/run", options=s3_server.options(), client_options={"allow_http": True}
        ),
    ) as ckpt:
        assert_state(await ckpt.restore(), 7, _BIG)


def test_hostile_keys_in_a_listing_are_ignored() -> None:
    good = [(data_key(3, 0), 10), (commit_key(3, 0), 5)]
    hostile = [
        ("../step_0000000009/rank00000.astage", 1),
        ("/etc/passwd", 1),
        ("step_0000000009/../rank00000.commit.json", 1),
        ("step_0000000009/rank00000.commit.json/x", 1),
        ("step_9/rank00000.commit.json", 1),
        ("step_0000000009/rank0.commit.json", 1),
        ("step_" + "9" * 10_000 + "/rank00000.commit.json", 1),
        ("step_0000000009/" + "a" * 100_000, 1),
        ("step_0000000009/rank00000.commit.json", -1),
    ]
    steps = group_listing(hostile + good)
    assert list(steps) == [3]
    assert steps[3].data == {0: 10}
    assert steps[3].commits == {0: 5}
    assert all(parse_key(k) is None for k, _ in hostile[:-1])


async def test_hostile_objects_on_a_file_store_are_never_followed(tmp_path: Path) -> None:
    store_dir = tmp_path / "store"
    remote = astage.Remote(store_dir.as_uri())
    async with astage.Checkpointer(tmp_path / "a", remote=remote) as ckpt:
        await (await ckpt.save(1, state(1))).uploaded()
    outside = tmp_path / "outside.astage"
    outside.write_bytes(b"secret")
    (store_dir / "step_0000000005").mkdir()
    (store_dir / "step_0000000005" / "rank00000.commit.json").write_text('{"format": "astage-remote-commit"}')
    (store_dir / "step_0000000006").mkdir()
    (store_dir / "step_0000000006" / "junk").write_text("x")
    (store_dir / ("x" * 200)).write_text("x")
    async with astage.Checkpointer(tmp_path / "fresh", remote=astage.Remote(store_dir.as_uri())) as ckpt:
        assert_state(await ckpt.restore(), 1)
    assert outside.read_bytes() == b"secret"


async def _rank_saves_then_dies(rank: int, world_size: int, endpoint: str, bucket: str, root: str) -> str:
    remote = astage.Remote(
        f"s3://{bucket}/run",
        options={
            "endpoint": endpoint,
            "access_key_id": "AKASTAGETEST",
            "secret_access_key": "SKastageTestSecret0123456789",
            "region": "us-east-1",
        },
        client_options={"allow_http": True},
        chunk_nbytes=5 << 20,
        world_size=world_size,
    )
    async with astage.Checkpointer(Path(root) / f"rank{rank}", rank=rank, remote=remote) as ckpt:
        await (await ckpt.save(1, state(10 + rank, 500_000))).uploaded()
        handle = await ckpt.save(2, state(20 + rank, 2_000_000))
        if rank == 1:
            await handle.wait()
            kill_self()  # during (or before) its upload of step 2
        await handle.uploaded()
    return "done"


async def test_a_rank_killed_during_its_upload_leaves_the_last_complete_step(
    s3_server: SeaweedS3, tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket()
    results = await anyio.to_thread.run_sync(
        lambda: run_group(2, _rank_saves_then_dies, s3_server.endpoint, bucket, str(tmp_path), timeout=120)
    )
    assert results[0].ok, results[0].traceback
    assert results[1].killed
    # New machines, empty disks: every rank gets step 1 (step 2 is incomplete), bit-exact.
    for rank in (0, 1):
        remote = astage.Remote(
            f"s3://{bucket}/run",
            options=s3_server.options(),
            client_options={"allow_http": True},
            world_size=2,
        )
        async with astage.Checkpointer(tmp_path / f"fresh{rank}", rank=rank, remote=remote) as ckpt:
            got = await ckpt.restore()
            assert_state(got, 10 + rank, 500_000)
            with pytest.raises(astage.ResourceError):
                await ckpt.restore(step=2)


async def test_cancelled_mid_upload_commits_nothing_and_the_next_run_uploads_it(
    s3_server: SeaweedS3, tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket()
    with fault_proxy(s3_server.ports["s3"]) as proxy:
        remote = proxied(s3_server, proxy, bucket)
        async with anyio.create_task_group() as tg:

            async def train() -> None:
                async with astage.Checkpointer(tmp_path / "a", remote=remote) as ckpt:
                    await (await ckpt.save(3, state(3, _BIG))).wait()
                    proxy.delay = 0.05  # a slow store: the upload is still running when cancelled
                    await anyio.to_thread.run_sync(proxy.wait_uploaded, 1 << 20)
                    tg.cancel_scope.cancel()

            tg.start_soon(train)
        proxy.delay = 0.0
        client = proxied(s3_server, proxy, bucket).client()
        assert commit_key(3, 0) not in {m["path"] for m in obstore.list(client.store).collect()}
        # The next run finds step 3 committed locally but not on the store: it uploads it.
        async with astage.Checkpointer(tmp_path / "a", remote=proxied(s3_server, proxy, bucket)) as ckpt:
            assert ckpt.steps() == [3]
            stats = await ckpt.wait_uploaded(3)
            assert stats is not None
    direct = astage.Remote(
        f"s3://{bucket}/run", options=s3_server.options(), client_options={"allow_http": True}
    )
    async with astage.Checkpointer(tmp_path / "fresh", remote=direct) as ckpt:
        assert_state(await ckpt.restore(), 3, _BIG)


async def test_local_retention_keeps_a_step_until_its_upload_ends(
    s3_server: SeaweedS3, tmp_path: Path
) -> None:
    bucket = s3_server.new_bucket()
    with fault_proxy(s3_server.ports["s3"]) as proxy:
        remote = proxied(s3_server, proxy, bucket)
        async with astage.Checkpointer(tmp_path / "a", remote=remote, keep=1) as ckpt:
            proxy.delay = 0.05  # a slow store: step 1's upload outlasts the next saves
            first = await ckpt.save(1, state(1, _BIG))
            await first.wait()
            await anyio.to_thread.run_sync(proxy.wait_uploaded, 1 << 20)
            for step in (2, 3):
                await (await ckpt.save(step, state(step))).wait()
            assert ckpt.steps() == [1, 2, 3]  # 1 uploading, 2 and 3 queued behind it: all stay
            proxy.delay = 0.0
            await ckpt.wait_uploaded(3)
            await (await ckpt.save(4, state(4))).uploaded()
            assert ckpt.steps() == [4]


async def test_deadlines_bound_a_slow_store(s3_server: SeaweedS3, tmp_path: Path) -> None:
    bucket = s3_server.new_bucket()
    with fault_proxy(s3_server.ports["s3"]) as proxy:
        remote = proxied(s3_server, proxy, bucket, deadline=1.0)
        async with astage.Checkpointer(tmp_path / "a", remote=remote, keep=None) as ckpt:
            proxy.delay = 0.05  # 48 MB at ~1.3 MB/s: far past the 1 s deadline
            handle = await ckpt.save(1, state(1, _BIG))
            with pytest.raises(astage.RemoteError, match="deadline"):
                await handle.uploaded()
            assert ckpt.steps() == [1]  # committed locally all the same
            with pytest.raises(TimeoutError):
                await ckpt.save_now_and_upload(2, state(2, _BIG), deadline=0.5)
            proxy.delay = 0.0
        keys = {m["path"] for m in obstore.list(proxied(s3_server, proxy, bucket).client().store).collect()}
        assert commit_key(1, 0) not in keys
