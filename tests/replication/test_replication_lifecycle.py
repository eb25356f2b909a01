"""ReplicationStager lifecycle over real gloo groups: arguments refused at construction, a
group broken only by what was posted on it (a failure after posting breaking it is covered
by the cancellation sweep), and stats that belong to their own call.

Each test runs several cases in one ``run_group`` (a group start costs ~0.5 s).
"""

from __future__ import annotations

import dataclasses
import math
from datetime import timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import astage
from astage import ConfigurationError, ReplicationPhase, _transport
from astage._format.codec import FileLayout
from tests.distributed import run_group
from tests.statedicts import bytes_equal

TIMEOUT = 20.0

# (keyword arguments, the argument the error must name); the world size is 2.
BAD_ARGUMENTS: list[tuple[dict[str, Any], str]] = [
    *(
        ({"chunk_bytes": value}, "chunk_bytes")
        for value in (1, 0, -1, 4095, (1 << 30) + 1, 4096.0, True, "65536", None)
    ),
    *(
        ({"timeout": value}, "timeout")
        for value in (
            0,
            -1.0,
            math.nan,
            math.inf,
            "5",
            True,
            None,
            timedelta(0),
            timedelta(seconds=-1),
        )
    ),
    *(({"peer_offset": value}, "peer_offset") for value in (0, 2, -2, 4, 1.0, True, "1")),
    *(({"max_replica_bytes": value}, "max_replica_bytes") for value in (0, -1, 1.5, True, 1 << 63, "1")),
    *(({"storage_dir": value}, "storage_dir") for value in (None, b"/tmp/x", 5, "", "a\0b")),
    ({"stager": object()}, "stager"),
    ({"stager": "DefaultStager"}, "stager"),
    ({"options": {"use_pinned_memory": False}}, "options"),
    ({"options": "default"}, "options"),
    ({"process_group": "world"}, "process_group"),
]

# The transport's own entry points, called with the peer's rank: each must refuse before
# it posts anything (else the peer would be left out of step).
BAD_TRANSPORT_ARGUMENTS: list[tuple[dict[str, Any], str]] = [
    *(({"chunk_bytes": value}, "chunk_bytes") for value in (1, 4096.5, True)),
    *(({"timeout": value}, "timeout") for value in (True, math.inf, "1", 0)),
    *(({"max_body_bytes": value}, "max_body_bytes") for value in ("1", -1, 1.5)),
    ({"max_prefix_bytes": 2.0}, "max_prefix_bytes"),
    *(({"send_to": value}, "send_to") for value in (True, 2, "1")),
    ({"allocate": 5}, "allocate"),
    ({"on_chunk": "print"}, "on_chunk"),
]


async def bad_arguments_target(rank: int, world: int, root: str) -> dict[str, Any]:
    refused: list[tuple[str, str, str]] = []
    for kwargs, _ in BAD_ARGUMENTS:
        args: dict[str, Any] = {"storage_dir": Path(root) / f"rank{rank}", **kwargs}
        try:
            astage.ReplicationStager(**args)
        except Exception as exc:  # the type is what is checked
            refused.append((repr(kwargs), type(exc).__name__, str(exc)))
        else:
            refused.append((repr(kwargs), "accepted", ""))
    # options with a stager: the options would be ignored silently.
    async with astage.DefaultStager() as own:
        try:
            astage.ReplicationStager(storage_dir=root, stager=own, options=astage.StagingOptions())
        except ConfigurationError as exc:
            both = str(exc)
        else:
            both = "accepted"
    others: list[tuple[str, str, str]] = []  # the transport, Payload, replicate()
    peer = 1 - rank
    for kwargs, _ in BAD_TRANSPORT_ARGUMENTS:
        call: dict[str, Any] = {"send_to": peer, "recv_from": peer, "timeout": 5.0, "max_body_bytes": 1 << 20}
        try:
            await _transport.exchange(None, _transport.Payload(b"h", (), 0), **{**call, **kwargs})
        except Exception as exc:  # the type is what is checked
            others.append((repr(kwargs), type(exc).__name__, str(exc)))
        else:
            others.append((repr(kwargs), "accepted", ""))
    for prefix, body_nbytes in (("h", 0), (b"h", -1), (b"h", 1.0)):
        try:
            _transport.Payload(prefix, (), body_nbytes)  # type: ignore[arg-type]
        except ConfigurationError as exc:
            others.append(("Payload", "ConfigurationError", str(exc)))
        else:
            others.append(("Payload", "accepted", ""))
    # After all that, a well-configured stager on the same group replicates, once it has
    # refused bad call arguments before staging anything.
    async with astage.ReplicationStager(storage_dir=Path(root) / f"rank{rank}", timeout=TIMEOUT) as rs:
        for call_kwargs in ({"step": 1.5}, {"step": True}, {"step": 1 << 63}, {"checkpoint_id": 7}):
            try:
                await rs.replicate({"x": torch.ones(2)}, **call_kwargs)
            except ConfigurationError as exc:
                others.append((repr(call_kwargs), "ConfigurationError", str(exc)))
            else:
                others.append((repr(call_kwargs), "accepted", ""))
        result = await rs.replicate({"x": torch.full((8,), float(rank))}, step=1)
        replica_ok = bytes_equal(result.replica["x"], torch.full((8,), float(1 - rank)))
    return {"refused": refused, "others": others, "both": both, "replica_ok": replica_ok}


def test_every_bad_argument_is_refused_at_construction_naming_it(tmp_path: Path) -> None:
    for result in run_group(2, bad_arguments_target, str(tmp_path), timeout=60):
        value = result.unwrap()
        for (_, name), (shown, kind, message) in zip(BAD_ARGUMENTS, value["refused"], strict=True):
            assert kind == "ConfigurationError", (shown, kind, message)
            assert name in message, (shown, message)
        other_cases = [
            *BAD_TRANSPORT_ARGUMENTS,
            *(({}, name) for name in ("prefix", "body_nbytes", "body_nbytes")),
            *(({}, name) for name in ("step", "step", "step", "checkpoint_id")),
        ]
        for (_, name), (shown, kind, message) in zip(other_cases, value["others"], strict=True):
            assert kind == "ConfigurationError", (shown, kind, message)
            assert name in message, (shown, message)
        assert "options or stager" in value["both"]
        assert value["replica_ok"]


async def posted_nothing_target(rank: int, world: int, root: str) -> dict[str, Any]:
    storage = Path(root) / f"rank{rank}"
    real_encode = FileLayout.encode

    def encode_unsendable(self: FileLayout) -> Any:
        # A layout the transport refuses while planning its chunks, before it posts
        # anything: the same ConfigurationError as any argument it would refuse.
        encoded = real_encode(self)
        offset, data = encoded.segments[0]
        return dataclasses.replace(encoded, segments=((offset, data.view(torch.int8)), *encoded.segments[1:]))

    async with astage.ReplicationStager(storage_dir=storage, timeout=TIMEOUT) as rs:
        FileLayout.encode = encode_unsendable  # type: ignore[method-assign]
        try:
            await rs.replicate({"x": torch.arange(10.0) + rank}, step=1)
        except ConfigurationError as exc:
            first = f"{type(exc).__name__}: {exc}"
        else:
            first = "no error"
        finally:
            FileLayout.encode = real_encode  # type: ignore[method-assign]
        after_failure = (rs.phase, rs.broken)
        second = await rs.replicate({"x": torch.arange(10.0) + rank}, step=2)
        return {
            "first": first,
            "after_failure": after_failure,
            "second_ok": bytes_equal(second.replica["x"], torch.arange(10.0) + (1 - rank)),
            "after_success": (rs.phase, rs.broken),
        }


def test_a_failure_before_anything_is_posted_leaves_the_group_usable(tmp_path: Path) -> None:
    for result in run_group(2, posted_nothing_target, str(tmp_path), timeout=60):
        value = result.unwrap()
        assert value["first"].startswith("ConfigurationError"), value
        assert value["after_failure"] == (ReplicationPhase.STAGED, False)
        assert value["second_ok"]
        assert value["after_success"] == (ReplicationPhase.ACKNOWLEDGED, False)


async def concurrent_stats_target(rank: int, world: int, root: str, inline: bool) -> list[tuple[int, int]]:
    options = astage.StagingOptions(use_async_staging=not inline)
    sizes = [1 << 10, 1 << 16, 1 << 12]
    async with astage.ReplicationStager(
        storage_dir=Path(root) / f"rank{rank}", timeout=TIMEOUT, options=options
    ) as rs:
        reported: list[tuple[int, int]] = []

        async def one(n: int) -> None:
            result = await rs.replicate({"x": torch.zeros(n, dtype=torch.uint8)}, step=n)
            assert result.stats.stage is not None
            reported.append((n, result.stats.stage.bytes))

        async with anyio.create_task_group() as tg:
            for n in sizes:
                tg.start_soon(one, n)
        return reported


@pytest.mark.parametrize("inline", [False, True], ids=["threads", "inline"])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_concurrent_replicates_each_report_their_own_stage_stats(
    tmp_path: Path, backend: str, inline: bool
) -> None:
    for result in run_group(2, concurrent_stats_target, str(tmp_path), inline, timeout=60, backend=backend):
        reported = result.unwrap()
        assert len(reported) == 3
        for n, staged_bytes in reported:
            assert staged_bytes == n, reported
