"""Sizes and limits that several modules must agree on, each defined once.

A limit that belongs to one module's format or protocol stays there; what lives here is
shared: bounds of the on-disk integers and the default size of a streamed chunk.
"""

from __future__ import annotations

from typing import Final

INT64: Final = 1 << 63
"""Exclusive bound of a non-negative int64 (steps, sizes and offsets on disk)."""
RANK_LIMIT: Final = 1 << 31
"""Exclusive bound of a rank: torch.distributed ranks are int32."""
CHUNK_BYTES: Final = 16 << 20
"""Default chunk of a streamed body (a transport message, a file write): large enough to
amortise a call, small enough to pipeline."""
