"""The remote-tier tests' S3 server: one SeaweedFS on 127.0.0.1 per session
(:mod:`benchmarks.s3server` starts it); the tests that need it skip cleanly, with the
reason, where the ``weed`` binary is missing or the server cannot start."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import pytest

from benchmarks.s3server import (
    ACCESS_KEY,
    READONLY_KEY,
    READONLY_SECRET,
    SECRET_KEY,
    SeaweedS3,
    start_seaweed,
)

__all__ = [
    "ACCESS_KEY",
    "READONLY_KEY",
    "READONLY_SECRET",
    "SECRET_KEY",
    "SeaweedS3",
    "s3_server",
    "seaweed_server",
]


@contextlib.contextmanager
def seaweed_server() -> Iterator[SeaweedS3]:
    """A started SeaweedFS S3 server, stopped and its data removed on exit.

    :raises pytest.skip.Exception: the ``weed`` binary is missing or the server cannot start.
    """
    server, why = start_seaweed()
    if server is None:
        pytest.skip(why)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[SeaweedS3]:
    """One SeaweedFS S3 server for the session (started on first use)."""
    with seaweed_server() as server:
        yield server
