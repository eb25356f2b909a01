"""The event adapter: awaiting device events without blocking the loop."""

from __future__ import annotations

import threading
import time

import anyio
import pytest
import torch

from astage import wait_event

pytestmark = pytest.mark.anyio


class ThreadDoneEvent:
    """A real event-like object: completes when a worker thread finishes its work."""

    def __init__(self, seconds: float) -> None:
        self.queries = 0
        self._done = threading.Event()
        threading.Thread(target=self._work, args=(seconds,), daemon=True).start()

    def _work(self, seconds: float) -> None:
        time.sleep(seconds)
        self._done.set()

    def query(self) -> bool:
        self.queries += 1
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


async def test_a_completed_torch_event_returns_at_once() -> None:
    event = torch.Event()  # a real CPU event: nothing recorded, so complete
    assert event.query()
    with anyio.fail_after(0.5):
        await wait_event(event)


async def test_polling_waits_for_completion_and_backs_off() -> None:
    event = ThreadDoneEvent(0.1)
    started = time.perf_counter()
    await wait_event(event, max_delay=0.002)
    elapsed = time.perf_counter() - started
    assert event.query()
    assert elapsed >= 0.09
    # Back-off: far fewer queries than a busy loop, yet at least one per 2 ms cap.
    assert 5 < event.queries < 200


class ReleasedByTheLoop:
    """An event that completes only once another task on the loop has released it.

    A ``wait_event`` that held the loop would never let that task run: ``query`` then
    gives up after ``patience`` seconds (so a blocking regression ends instead of hanging)
    and reports complete without having been released.
    """

    def __init__(self, patience: float = 5.0) -> None:
        self.released = threading.Event()
        self._give_up_at = time.monotonic() + patience

    def query(self) -> bool:
        return self.released.is_set() or time.monotonic() > self._give_up_at


async def test_the_loop_keeps_running_while_waiting() -> None:
    event = ReleasedByTheLoop()
    turns = 0

    async def other_task() -> None:
        nonlocal turns
        for _ in range(10):  # ten turns of the loop, each a timed sleep like a heartbeat's
            turns += 1
            await anyio.sleep(0.001)
        event.released.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_task)
        await wait_event(event)
        released_by_the_loop = event.released.is_set()
    assert released_by_the_loop, "wait_event returned without the loop running the other task"
    assert turns == 10


@pytest.mark.parametrize("strategy", ["poll", "thread"])
async def test_waiting_is_cancellable(strategy: str) -> None:
    event = ThreadDoneEvent(5.0)
    started = time.perf_counter()
    with anyio.move_on_after(0.05):
        await wait_event(event, strategy=strategy)  # type: ignore[arg-type]
    assert time.perf_counter() - started < 1.0
    assert not event.query()


async def test_thread_strategy_waits_for_completion() -> None:
    event = ThreadDoneEvent(0.05)
    await wait_event(event, strategy="thread")
    assert event.query()


async def test_thread_strategy_needs_synchronize() -> None:
    class QueryOnly:
        def query(self) -> bool:
            return False

    with pytest.raises(TypeError, match="synchronize"):
        await wait_event(QueryOnly(), strategy="thread")


@pytest.mark.gpu
async def test_a_cuda_event_after_real_device_work() -> None:
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    event = torch.cuda.Event()
    event.record()
    await wait_event(event)
    assert event.query()
