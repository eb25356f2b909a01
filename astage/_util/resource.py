"""The async context-manager pair, written once: ``async with`` enters and ``aclose()`` exits.

Every astage resource follows trio's ``AsyncResource`` contract (anyio's
:class:`anyio.abc.AsyncResource`): ``aclose()`` always releases what it holds, even when it
fails, and is idempotent; leaving ``async with`` calls it.  Resources that must do work on
entering, or must know how the block ended, override :meth:`AsyncResource._enter` and
:meth:`AsyncResource._exit` instead of writing the pair again.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

import anyio.abc


class AsyncResource(anyio.abc.AsyncResource):
    """:class:`anyio.abc.AsyncResource` with an entering hook and an exit that sees the error."""

    __slots__ = ()

    async def __aenter__(self) -> Self:
        await self._enter()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._exit(exc)

    async def _enter(self) -> None:
        """What ``async with`` does before the block runs (nothing by default)."""

    async def _exit(self, exc: BaseException | None) -> None:
        """What leaving ``async with`` does; ``exc`` ended the block (default: :meth:`aclose`)."""
        await self.aclose()
