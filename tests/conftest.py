"""Shared fixtures: anyio backends, the GPU marker, a one-rank process group, and a guard
against a blocked loop."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

# The session's S3 server (SeaweedFS on 127.0.0.1), for the remote-tier tests.
from tests.s3server import s3_server  # noqa: F401 - a fixture


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run every ``@pytest.mark.anyio`` test under asyncio and under trio."""
    return str(request.param)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo group of this process alone (DTensors and DCP need a default group)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
