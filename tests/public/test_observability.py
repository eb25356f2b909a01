"""What astage tells an operator: its logger's handler, the cap-wait log line, stats reprs."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys

import anyio
import pytest
import torch

from astage import ConfigurationError, DefaultStager, StageStats, StagingOptions
from astage._staging.pool import BufferPool

POOL_LOGGER = "astage.pool"


class _Signal(logging.Handler):
    """Sets an event (from any thread) when a record at INFO or above reaches the logger."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen = anyio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        # The pool logs on the event loop's thread; run_sync_from_thread would deadlock there.
        self.seen.set()


def _held(lease_storages: list[torch.UntypedStorage]) -> list[torch.Tensor]:
    return [torch.empty(0, dtype=torch.uint8).set_(s) for s in lease_storages]


def test_the_astage_logger_has_a_null_handler() -> None:
    handlers = logging.getLogger("astage").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def test_a_warning_of_an_unconfigured_application_stays_off_stderr() -> None:
    # Python's last-resort handler prints WARNING records to stderr when no handler exists.
    code = "import astage, logging; logging.getLogger('astage.persist').warning('should stay quiet')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "should stay quiet" not in done.stderr


@pytest.mark.anyio
async def test_a_wait_under_the_cap_is_logged_once_with_what_holds_the_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = BufferPool(max_bytes=3000, wait_log_seconds=0.05)
    first, second = await pool.acquire([1000]), await pool.acquire([500, 500])
    copies = [_held(first.storages), _held(second.storages)]
    pool.hand_out(first)
    pool.hand_out(second)
    signal = _Signal()
    logger = logging.getLogger(POOL_LOGGER)
    logger.addHandler(signal)
    try:
        with caplog.at_level(logging.INFO, logger=POOL_LOGGER):
            async with anyio.create_task_group() as tg:
                got: list[BufferPool] = []

                async def wait_for_room() -> None:
                    await pool.acquire([2000])
                    got.append(pool)

                tg.start_soon(wait_for_room)
                with anyio.fail_after(10):
                    await signal.seen.wait()
                assert not got  # logged while still waiting
                copies.clear()
                gc.collect()
    finally:
        logger.removeHandler(signal)
    assert got
    records = [r for r in caplog.records if r.name == POOL_LOGGER and r.levelno == logging.INFO]
    assert len(records) == 1, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert "max_staging_bytes=3,000" in message
    assert "needs 2,000 bytes" in message
    assert "2,000 bytes are held by 2 staged copies not yet released" in message


@pytest.mark.anyio
async def test_a_short_wait_under_the_cap_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    pool = BufferPool(max_bytes=1000)
    lease = await pool.acquire([1000])
    held = _held(lease.storages)
    pool.hand_out(lease)
    with caplog.at_level(logging.DEBUG, logger=POOL_LOGGER):
        async with anyio.create_task_group() as tg:
            tg.start_soon(pool.acquire, [1000])
            await anyio.wait_all_tasks_blocked()
            del held
            gc.collect()
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]


@pytest.mark.anyio
async def test_a_stager_waiting_about_a_second_under_its_cap_logs_at_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The default threshold, through the public stager: real time is the behaviour here."""
    state = {"w": torch.ones(256)}
    signal = _Signal()
    logger = logging.getLogger(POOL_LOGGER)
    logger.addHandler(signal)
    try:
        async with DefaultStager(StagingOptions(max_staging_bytes=1024)) as stager:
            held = await stager.stage(state)
            with caplog.at_level(logging.INFO, logger=POOL_LOGGER):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stager.stage, state)
                    started = anyio.current_time()
                    with anyio.fail_after(10):
                        await signal.seen.wait()
                    waited = anyio.current_time() - started
                    del held
                    gc.collect()
    finally:
        logger.removeHandler(signal)
    assert 0.9 <= waited < 5
    assert "1,024 bytes are held by 1 staged copy not yet released" in caplog.text


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_the_wait_log_threshold_is_validated(bad: float) -> None:
    with pytest.raises(ConfigurationError, match="wait_log_seconds"):
        BufferPool(wait_log_seconds=bad)


def test_stage_stats_repr_shows_the_throughput() -> None:
    stats = StageStats(
        tensors=3, storages=2, bytes=3_000_000_000, bytes_allocated=0, reused_buffers=2, seconds=1.5,
        wait_seconds=0.25,
    )  # fmt: skip
    text = repr(stats)
    assert "2.00 GB/s" in text
    assert "bytes=3,000,000,000" in text
    assert "wait_seconds=0.2500" in text
