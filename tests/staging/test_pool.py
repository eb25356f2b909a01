"""The buffer pool on its own: reuse, caps, FIFO fairness, closing, buffer kinds."""

from __future__ import annotations

import gc

import anyio
import anyio.lowlevel
import psutil
import pytest
import torch

from astage import CapacityError, ClosedError
from astage._staging.pool import BufferKind, BufferPool, Lease
from tests.helpers import heartbeat_gaps

pytestmark = pytest.mark.anyio


def hold(lease_storages: list[torch.UntypedStorage]) -> list[torch.Tensor]:
    """What a staged copy does: tensors viewing the leased storages."""
    return [torch.empty(0, dtype=torch.uint8).set_(s) for s in lease_storages]


async def test_buffers_of_a_given_back_lease_are_reused() -> None:
    pool = BufferPool()
    lease = await pool.acquire([100, 200])
    storages = [s.data_ptr() for s in lease.storages]
    pool.give_back(lease)
    again = await pool.acquire([200, 100])
    assert again.allocated_bytes == 0
    assert sorted(s.data_ptr() for s in again.storages) == sorted(storages)
    assert [s.nbytes() for s in again.storages] == [200, 100]


async def test_handed_out_buffers_come_back_only_when_unreferenced() -> None:
    pool = BufferPool()
    lease = await pool.acquire([64])
    views = hold(lease.storages)
    pool.hand_out(lease)
    del lease
    assert pool.reclaim() == 0
    assert pool.stats().handed_out_bytes == 64
    del views
    gc.collect()
    assert pool.reclaim() == 64
    assert pool.stats().free_bytes == 64


async def test_a_storage_object_held_by_a_caller_counts_as_a_reference() -> None:
    pool = BufferPool()
    lease = await pool.acquire([32])
    storage = lease.storages[0]
    pool.hand_out(lease)
    del lease
    assert pool.reclaim() == 0
    del storage
    assert pool.reclaim() == 32


async def test_a_buffer_its_holder_resized_is_accounted_as_leased_and_not_reused() -> None:
    pool = BufferPool()
    lease = await pool.acquire([48, 16])
    views = hold(lease.storages)
    pool.hand_out(lease)
    del lease
    views[0].untyped_storage().resize_(8)  # the caller's copy, the caller's business
    del views
    assert pool.reclaim() == 64  # what was handed out comes back to the accounts
    stats = pool.stats()
    assert (stats.handed_out_bytes, stats.free_bytes, stats.total_bytes) == (0, 16, 16)
    again = await pool.acquire([48])
    assert again.allocated_bytes == 48
    assert again.storages[0].nbytes() == 48


async def test_new_buffers_are_faulted_in_by_the_first_copy_not_by_the_pool() -> None:
    # Faulting every page in at allocation (one thread a buffer) made a first stage up to 3x
    # slower than letting the copy fault them in, in its own threads (astage._staging.pool).
    size = 64 << 20
    before = psutil.Process().memory_info().rss
    lease = await BufferPool().acquire([size])
    assert psutil.Process().memory_info().rss - before < 0.1 * size, "the pool faulted the pages in"
    assert lease.storages[0].nbytes() == size
    torch.empty(0, dtype=torch.uint8).set_(lease.storages[0]).fill_(1)
    assert psutil.Process().memory_info().rss - before >= 0.9 * size


async def test_waiters_are_served_first_in_first_out() -> None:
    pool = BufferPool(max_bytes=100)
    first = await pool.acquire([60, 40])  # later leases reuse these: no allocation awaits
    granted: list[int] = []
    leases: dict[int, Lease] = {}

    async def waiter(i: int) -> None:
        leases[i] = await pool.acquire([60 if i % 2 else 40])
        granted.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(waiter, i)
            await anyio.wait_all_tasks_blocked()  # waiter i is queued before i + 1 starts
        assert pool.stats().waiters == 6
        pool.give_back(first)
        # Granted in queue order, two at a time (40 + 60 fill the cap).  Each pair holds its
        # leases until the test gives them back: the order in which trio resumes tasks woken
        # together is arbitrary, so a waiter that gave back on its own could let the next
        # pair in before its partner had recorded its grant.
        for pair in ({0, 1}, {2, 3}, {4, 5}):
            await anyio.wait_all_tasks_blocked()
            assert set(granted) == pair, granted
            granted.clear()
            for i in sorted(pair):
                pool.give_back(leases.pop(i))
    assert pool.stats().total_bytes <= 100


async def test_idle_buffers_of_other_sizes_are_evicted_to_make_room() -> None:
    pool = BufferPool(max_bytes=100)
    pool.give_back(await pool.acquire([30, 30, 30]))
    assert pool.stats().free_bytes == 90
    lease = await pool.acquire([70])
    assert pool.stats().total_bytes <= 100
    assert lease.allocated_bytes == 70


async def test_an_oversized_request_fails_without_waiting() -> None:
    pool = BufferPool(max_bytes=100)
    with anyio.fail_after(1), pytest.raises(CapacityError):
        await pool.acquire([60, 60])


async def test_cancelled_waiter_leaves_the_queue_and_the_books_balanced() -> None:
    pool = BufferPool(max_bytes=100)
    lease = await pool.acquire([100])
    with anyio.move_on_after(0.05):
        await pool.acquire([50])
    stats = pool.stats()
    assert stats.waiters == 0
    assert stats.total_bytes == stats.leased_bytes == 100
    pool.give_back(lease)
    assert (await pool.acquire([50])).allocated_bytes == 50


async def test_closing_wakes_waiters_with_a_closed_error() -> None:
    pool = BufferPool(max_bytes=10)
    await pool.acquire([10])
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await pool.acquire([10])
        except ClosedError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        assert pool.stats().waiters == 1
        await pool.aclose()
        await pool.aclose()
    assert len(errors) == 1


async def test_retain_false_frees_buffers_on_return() -> None:
    pool = BufferPool(retain=False)
    pool.give_back(await pool.acquire([10]))
    assert pool.stats().total_bytes == 0


async def test_shared_buffers_are_in_shared_memory() -> None:
    pool = BufferPool(BufferKind.SHARED)
    lease = await pool.acquire([4096, 8])
    assert all(s.is_shared() for s in lease.storages)


@pytest.mark.gpu
async def test_pinned_buffers_are_page_locked() -> None:
    pool = BufferPool(BufferKind.PINNED)
    lease = await pool.acquire([1 << 20])
    assert lease.storages[0].is_pinned()


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_closing_a_big_pool_gives_the_loop_its_turn_while_it_frees() -> None:
    # Freeing a buffer unmaps its memory on the thread that drops the last reference, with
    # the GIL held: 1.5 GB dropped at once held the loop 25-90 ms.  Now a few at a time.
    # (asyncio only: trio's worker threads keep the last call's buffers, so the pool's
    # references are not the last ones there.)
    pool = BufferPool()
    # 40 MiB a buffer: above glibc's largest mmap threshold (32 MiB), so each is unmapped
    # when freed, whatever earlier frees did to the threshold; written, so pages are real.
    lease = await pool.acquire([40 << 20] * 20)
    for storage in lease.storages:
        torch.empty(0, dtype=torch.uint8).set_(storage).fill_(1)
    pool.give_back(lease)
    del lease
    beats = await heartbeat_gaps(pool.aclose)
    assert pool.stats().total_bytes == 0
    assert beats.busy, "freeing 800 MiB takes some beats"
    assert max(beats.busy) < 0.05, sorted(beats.busy)[-3:]  # one buffer: ~5-15 ms


async def test_taking_back_many_dropped_buffers_gives_the_loop_its_turn() -> None:
    # A staged copy of 20,000 tensors dropped by its holder (every reference gone, torch's
    # habit) comes back when the next stage asks for room: checking and moving 20,000
    # buffers back at once held the loop ~30 ms.  Now a block at a time, in slices.  Then
    # taking them, a Python step a buffer, held it ~10 ms in one step (thread CPU time,
    # measured); now a size's bucket at a time, after a turn: ~3 ms.
    pool = BufferPool()
    sizes = [256] * 20_000
    lease = await pool.acquire(sizes)
    views = hold(lease.storages)
    pool.hand_out(lease)
    del lease, views  # dropped: nothing references the buffers any more
    reused: list[int] = []

    async def next_stage() -> None:
        reused.append((await pool.acquire(sizes)).reused_buffers)

    beats = await heartbeat_gaps(next_stage)
    assert reused == [20_000]
    assert len(beats.busy) > 1, "the loop had its turns while the buffers came back"
    assert max(beats.busy) < 0.006, sorted(beats.busy)[-3:]
