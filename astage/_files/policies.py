"""Retention policies: which committed steps a tier keeps.  Pure functions of the steps.

A policy looks at every step a tier holds (:class:`StepInfo`: the step, when it was
committed, the metrics passed to ``save()``) and names those it wants kept; policies
combine with ``|`` (a step stays if any of them wants it)::

    latest(3)                              # the three newest steps
    every_steps(1000) | latest(2)          # every 1000th step, and the two newest
    best(2, "loss") | latest(1)            # the two lowest losses, and the newest
    keep_if(lambda s: s.step < 100)        # any predicate

Whatever the policy says, :func:`retained` always keeps the newest step (a tier never
deletes its latest checkpoint), and the tiers add the steps another tier still needs
(a step waiting for its upload stays on disk).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from .._util.errors import ConfigurationError


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a policy knows of one committed step.

    :ivar step: the step.
    :ivar created: when it was committed (seconds since the epoch).
    :ivar metrics: the ``metrics`` passed to ``save()`` (empty if none, or not known).
    """

    step: int
    created: float
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


class Policy:
    """A retention policy: :meth:`wanted` names the steps it keeps.  Combine with ``|``."""

    def wanted(self, steps: list[StepInfo]) -> set[int]:
        """The steps of ``steps`` (sorted by step, oldest first) that this policy keeps."""
        raise NotImplementedError

    def __or__(self, other: Policy) -> Policy:
        if not isinstance(other, Policy):
            return NotImplemented
        return AnyOf((self, other))


@dataclasses.dataclass(frozen=True, repr=False)
class AnyOf(Policy):
    """Keeps what any of its policies keeps."""

    policies: tuple[Policy, ...]

    def wanted(self, steps: list[StepInfo]) -> set[int]:
        kept: set[int] = set()
        for policy in self.policies:
            kept |= policy.wanted(steps)
        return kept

    def __or__(self, other: Policy) -> Policy:
        if not isinstance(other, Policy):
            return NotImplemented
        return AnyOf((*self.policies, other))

    def __repr__(self) -> str:
        return " | ".join(repr(p) for p in self.policies)


def _count(name: str, n: object) -> int:
    if type(n) is not int or n < 1:
        raise ConfigurationError(f"{name}(n): n must be an int >= 1, got {n!r}")
    return n


@dataclasses.dataclass(frozen=True, repr=False)
class _Latest(Policy):
    n: int

    def wanted(self, steps: list[StepInfo]) -> set[int]:
        return {s.step for s in steps[-self.n :]}

    def __repr__(self) -> str:
        return f"latest({self.n})"


@dataclasses.dataclass(frozen=True, repr=False)
class _EverySteps(Policy):
    n: int

    def wanted(self, steps: list[StepInfo]) -> set[int]:
        return {s.step for s in steps if s.step % self.n == 0}

    def __repr__(self) -> str:
        return f"every_steps({self.n})"


@dataclasses.dataclass(frozen=True, repr=False)
class _EverySeconds(Policy):
    seconds: float

    def wanted(self, steps: list[StepInfo]) -> set[int]:
        # The first step of each window of ``seconds`` (by commit time), oldest first: the
        # choice depends only on the steps before, so a kept step stays kept.
        kept: set[int] = set()
        last: float | None = None
        for s in sorted(steps, key=lambda s: (s.created, s.step)):
            if last is None or s.created - last >= self.seconds:
                kept.add(s.step)
                last = s.created
        return kept

    def __repr__(self) -> str:
        return f"every_seconds({self.seconds:g})"


@dataclasses.dataclass(frozen=True, repr=False)
class _Best(Policy):
    n: int
    metric: str
    mode: Literal["min", "max"]

    def wanted(self, steps: list[StepInfo]) -> set[int]:
        scored = [
            (value, s.step)
            for s in steps
            if isinstance(value := s.metrics.get(self.metric), int | float) and math.isfinite(value)
        ]
        # Ties go to the newer step.
        scored.sort(key=lambda vs: (vs[0] if self.mode == "min" else -vs[0], -vs[1]))
        return {step for _, step in scored[: self.n]}

    def __repr__(self) -> str:
        return f"best({self.n}, {self.metric!r}, mode={self.mode!r})"


@dataclasses.dataclass(frozen=True, repr=False)
class _KeepIf(Policy):
    predicate: Callable[[StepInfo], bool]

    def wanted(self, steps: list[StepInfo]) -> set[int]:
        return {s.step for s in steps if self.predicate(s)}

    def __repr__(self) -> str:
        return f"keep_if({getattr(self.predicate, '__name__', 'predicate')})"


def latest(n: int) -> Policy:
    """Keep the ``n`` newest steps."""
    return _Latest(_count("latest", n))


def every_steps(n: int) -> Policy:
    """Keep every step that is a multiple of ``n``."""
    return _EverySteps(_count("every_steps", n))


def every_seconds(seconds: float) -> Policy:
    """Keep one step per ``seconds`` of commit time (the first of each window)."""
    if type(seconds) not in (int, float) or not (math.isfinite(seconds) and seconds > 0):
        raise ConfigurationError(f"every_seconds(seconds): expected a positive number, got {seconds!r}")
    return _EverySeconds(float(seconds))


def best(n: int, metric: str, mode: Literal["min", "max"] = "min") -> Policy:
    """Keep the ``n`` steps with the lowest (``mode="min"``) or highest ``metric``, as
    passed to ``save(..., metrics={metric: value})``; steps without it are not counted."""
    if not isinstance(metric, str) or not metric:
        raise ConfigurationError(f"best(): metric must be a non-empty str, got {metric!r}")
    if mode not in ("min", "max"):
        raise ConfigurationError(f"best(): mode must be 'min' or 'max', got {mode!r}")
    return _Best(_count("best", n), metric, mode)


def keep_if(predicate: Callable[[StepInfo], bool]) -> Policy:
    """Keep the steps for which ``predicate(StepInfo)`` is true."""
    if not callable(predicate):
        raise ConfigurationError("keep_if(predicate): predicate must be callable")
    return _KeepIf(predicate)


def as_policy(name: str, value: Policy | int | None) -> Policy | None:
    """``value`` as a policy: an int ``n`` is ``latest(n)``; ``None`` keeps everything."""
    if value is None or isinstance(value, Policy):
        return value
    if type(value) is int and value >= 1:
        return latest(value)
    raise ConfigurationError(f"{name} must be a retention policy, an int >= 1 or None, got {value!r}")


def retained(policy: Policy | None, steps: Iterable[StepInfo], pinned: Iterable[int] = ()) -> set[int]:
    """The steps a tier keeps: what ``policy`` wants, the newest step, and ``pinned``
    (steps another tier still needs).  ``None`` keeps every step."""
    ordered = sorted(steps, key=lambda s: s.step)
    if policy is None:
        return {s.step for s in ordered}
    kept = policy.wanted(ordered) | set(pinned)
    if ordered:
        kept.add(ordered[-1].step)
    return kept & {s.step for s in ordered}
