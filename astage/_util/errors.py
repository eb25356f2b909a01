"""The astage exception hierarchy.

One root, :class:`AstageError`, and a few groups a caller can catch by meaning:
configuration, unsupported input, closed or exhausted resources, peers and transport,
integrity of stored bytes, and persistence.  Leaves say what happened and where: errors
about a user's state_dict carry the key path of the offending value.  Lower-level errors
(``OSError``, c10d, CUDA) are translated at the boundary with ``raise ... from exc``.
A task group's ``ExceptionGroup`` never crosses a public call: :class:`one_error` raises
the single error it wraps.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import anyio

KeyPath = tuple[object, ...]
"""A path into a state_dict: dict keys, sequence indices and ``.attribute`` names."""


def format_key_path(path: Sequence[object]) -> str:
    """Render a key path the way Python would index it: ``state_dict['opt']['state'][0].x``."""
    parts = ["state_dict"]
    for entry in path:
        if isinstance(entry, Attr):
            parts.append(f".{entry.name}")
        else:
            parts.append(f"[{shown_key(entry)}]")
    return "".join(parts)


def shown_key(key: object) -> str:
    """``repr(key)``, but an int too long for Python to print (past its 4,300-digit limit,
    where ``repr`` raises ``ValueError``) as its size: an error about it must not fail."""
    if type(key) is int and key.bit_length() > 10_000:
        return f"<int of {key.bit_length()} bits>"
    return repr(key)


class Attr:
    """A key path entry for an attribute (``obj.name``) rather than an item (``obj[name]``)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Attr({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Attr) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("Attr", self.name))


class AstageError(Exception):
    """Root of every error astage raises on purpose."""


class ConfigurationError(AstageError, ValueError):
    """Options or arguments that cannot work on this machine or together."""


class UnsupportedInputError(AstageError, TypeError):
    """A value in the state_dict that astage cannot stage or serialise faithfully.

    :ivar key_path: where in the state_dict the value sits.
    """

    def __init__(self, key_path: Sequence[object], message: str) -> None:
        self.key_path: KeyPath = tuple(key_path)
        super().__init__(f"{format_key_path(self.key_path)}: {message}")


class DestinationMismatchError(UnsupportedInputError):
    """The destination of ``restore(into=...)`` does not match the checkpoint; nothing was written.

    :ivar key_path: the first mismatching key path.
    :ivar problems: every ``(key path, what was expected and found)``, in the file's order.
    """

    def __init__(self, problems: list[tuple[KeyPath, str]]) -> None:
        super().__init__(problems[0][0], problems[0][1] + "; nothing was written")
        self.problems = problems
        if len(problems) > 1:
            self.add_note(f"{len(problems) - 1} more mismatch(es):")
            for path, message in problems[1 : 1 + _SHOWN]:
                self.add_note(f"  {format_key_path(path)}: {message}")
            if len(problems) > 1 + _SHOWN:
                self.add_note(f"  ... and {len(problems) - 1 - _SHOWN} more")


_SHOWN = 5
"""Mismatches a :class:`DestinationMismatchError` lists in its notes besides the first."""


class ResourceError(AstageError):
    """A resource astage manages is closed or cannot satisfy the request."""


class ClosedError(ResourceError, RuntimeError):
    """The stager, pool or transport was used after ``aclose()``."""


class EventLoopError(ResourceError, RuntimeError):
    """A stager was used from a second event loop while another was using it.

    A stager serves one event loop at a time: its waits and its thread limiter belong to
    the loop that is using it.  Use one stager per loop (per thread), or take turns.
    """


class CapacityError(ResourceError, MemoryError):
    """A single request is larger than the configured memory cap; waiting cannot help."""


class TransportError(AstageError):
    """Exchanging state with a peer rank failed."""


class PeerReportedError(TransportError):
    """The peer took part in the exchange but reports that it could not keep our replica.

    The process group is still healthy; the message carries the peer's reason.
    """


class PeerTimeoutError(TransportError, TimeoutError):
    """A peer did not complete its part of the exchange within the timeout."""


class IntegrityError(AstageError, ValueError):
    """Stored or received bytes are not a valid, untampered astage checkpoint file.

    The checkpoint file is the one format of a rank's local file, of a replica on a peer's
    disk, and of the state sent between ranks; a commit marker that is not valid is one too.
    """


class PersistError(AstageError, OSError):
    """Writing a file durably (a local checkpoint file, a replica, a marker) failed.

    The file that was there before under the same name is intact.
    """


class RemoteError(AstageError):
    """The object store (the remote tier) refused or failed an operation: wrong
    credentials, a missing bucket, a prefix owned by another run, or a transfer that kept
    failing past its retries or its deadline.  The message names the store's URL (never a
    credential), the operation and the key."""


def describe(exc: BaseException) -> str:
    """``"TypeName: message"``: how a failure is named inside another error's message."""
    return f"{type(exc).__name__}: {exc}"


class one_error:
    """Raise the error an ``ExceptionGroup`` wraps instead of the group.

    anyio's task groups wrap whatever their body or tasks raise in an ``ExceptionGroup``
    (always under trio, and under asyncio for an error); a public call raises the astage
    exception its docstring names, which ``except UnsupportedInputError`` must catch.  Of
    several errors the first astage one is raised (else the first other one: an
    interruption such as ``KeyboardInterrupt`` before any); each other is added to it as a
    note.  A group of cancellations only goes on as it is: its cancel scope takes it.  The
    error keeps its own cause and context, not the group (whose frames may view buffers).
    """

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not isinstance(exc, BaseExceptionGroup):
            return
        chosen = _chosen(exc)
        if chosen is None:
            return
        context = chosen.__context__
        del exc, tb
        try:
            raise chosen
        except BaseException:
            chosen.__context__ = context  # not the group being handled
            raise
        finally:
            del chosen, context


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves


def _chosen(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """The one error to raise for ``group`` (notes added), or ``None`` if it only cancels."""
    cancelled = anyio.get_cancelled_exc_class()
    leaves = [exc for exc in _leaves(group) if not isinstance(exc, cancelled)]
    if not leaves:
        return None
    chosen = next(
        (exc for exc in leaves if not isinstance(exc, Exception)),
        next((exc for exc in leaves if isinstance(exc, AstageError)), leaves[0]),
    )
    for other in leaves:
        if other is not chosen:
            chosen.add_note(f"also failed meanwhile: {describe(other)}")
    return chosen
