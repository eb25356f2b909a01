"""Transport payloads every rank can rebuild from the sender's seed, and the checks on them.

Shared by the gloo tests (``test_transport.py``) and the NCCL ones (``test_transport_nccl.py``).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import torch
import torch.distributed as dist

import astage
from astage._transport import Payload, Received, exchange, ring_peers

SMALL_CHUNK = 64 << 10
KINDS = ("tiny", "big", "sparse", "header-only", "nothing")


def make_payload(rank: int, kind: str) -> Payload:
    g = torch.Generator().manual_seed(rank * 1000 + KINDS.index(kind))

    def rand(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)

    if kind == "tiny":  # 20,000 segments of 1-64 B, separated by 0-8 zero bytes
        sizes = torch.randint(1, 65, (20_000,), generator=g).tolist()
        gaps = torch.randint(0, 9, (20_000,), generator=g).tolist()
        segments, offset = [], 0
        for size, gap in zip(sizes, gaps, strict=True):
            offset += gap
            segments.append((offset, rand(size)))
            offset += size
        return Payload(bytes(rand(1000).tolist()), segments, offset + 5)
    if kind == "big":  # a multi-chunk segment not aligned to chunks, a gap, a small one
        a = rand((1 << 20) + 37)
        b = rand(5000)
        b_at = 100 + a.numel() + 3
        return Payload(b"hdr" + bytes([rank]), [(100, a), (b_at, b)], b_at + b.numel() + 1000)
    if kind == "sparse":  # whole chunks of zeros around one 10-byte segment
        return Payload(b"", [(300 << 10, rand(10))], 512 << 10)
    if kind == "header-only":
        return Payload(f"only a header from {rank}".encode(), [], 0)
    return Payload(b"", [], 0)


def body_of(payload: Payload) -> bytes:
    body = bytearray(payload.body_nbytes)
    for offset, tensor in payload.segments:
        body[offset : offset + tensor.numel()] = tensor.numpy().tobytes()
    return bytes(body)


def check_received(got: Received, sender: int, kind: str) -> None:
    expected = make_payload(sender, kind)
    assert got.prefix == expected.prefix, f"{kind}: prefix from rank {sender} differs"
    assert got.body.numpy().tobytes() == body_of(expected), f"{kind}: body from rank {sender} differs"
    assert got.stats.bytes_received == len(expected.prefix) + expected.body_nbytes


async def ring_cases(
    pg: dist.ProcessGroup | None, offset: int | None, kinds: tuple[str, ...], chunk_bytes: int = SMALL_CHUNK
) -> list[tuple[int, int]]:
    """Exchange each kind along the ring; check what arrived; return (sent, received) bytes."""
    group = dist.group.WORLD if pg is None else pg
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    send_to, recv_from = ring_peers(rank, world, offset)
    me, sender = dist.get_global_rank(group, rank), dist.get_global_rank(group, recv_from)
    moved = []
    for kind in kinds:
        got = await exchange(
            pg,
            make_payload(me, kind),
            send_to=send_to,
            recv_from=recv_from,
            timeout=30,
            max_body_bytes=8 << 20,
            chunk_bytes=chunk_bytes,
        )
        check_received(got, sender, kind)
        moved.append((got.stats.bytes_sent, got.stats.bytes_received))
    return moved


async def outcome(call: Coroutine[Any, Any, object]) -> str:
    try:
        await call
    except astage.AstageError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"
