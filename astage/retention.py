"""Retention policies, composable and per tier: which committed steps a tier keeps.

``latest(3)`` for the local disk, ``every_steps(1000) | latest(2)`` for the store; a policy
never removes the newest step, nor a step another tier still waits for.
"""

from ._files.policies import Policy as Policy
from ._files.policies import StepInfo as StepInfo
from ._files.policies import best as best
from ._files.policies import every_seconds as every_seconds
from ._files.policies import every_steps as every_steps
from ._files.policies import keep_if as keep_if
from ._files.policies import latest as latest

__all__ = ["Policy", "StepInfo", "best", "every_seconds", "every_steps", "keep_if", "latest"]
