"""Checkpointer refuses every bad constructor argument at once, naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import astage
from astage import ConfigurationError


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"directory": None}, "directory"),
        ({"directory": 5}, "directory"),
        ({"directory": b"ckpt"}, "directory"),
        ({"directory": ""}, "directory"),
        ({"directory": "ck\0pt"}, "directory"),
        ({"stager": object()}, "stager"),
        ({"stager": "DefaultStager"}, "stager"),
        ({"fallback_dirs": "replicas"}, "fallback_dirs"),  # would be walked letter by letter
        ({"fallback_dirs": Path("replicas")}, "fallback_dirs"),
        ({"fallback_dirs": 5}, "fallback_dirs"),
        ({"fallback_dirs": [None]}, r"fallback_dirs\[0\]"),
        ({"fallback_dirs": ["ok", b"bytes"]}, r"fallback_dirs\[1\]"),
        ({"keep": 0}, "keep"),
        ({"keep": True}, "keep"),
        ({"max_in_flight": 0}, "max_in_flight"),
        ({"threads": 1.5}, "threads"),
        ({"rank": -1}, "rank"),
        ({"replication": object()}, "replication"),
        ({"on_progress": 3}, "on_progress"),
    ],
)
def test_every_bad_argument_is_refused_at_construction(
    tmp_path: Path, kwargs: dict[str, Any], named: str
) -> None:
    args: dict[str, Any] = {"directory": tmp_path / "ckpt", **kwargs}
    with pytest.raises(ConfigurationError, match=named):
        astage.Checkpointer(**args)
    assert not (tmp_path / "ckpt").exists()
