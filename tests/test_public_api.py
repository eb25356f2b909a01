"""The public surface: small, explicit, documented."""

from __future__ import annotations

import inspect

import astage


def test_all_lists_exactly_the_public_names() -> None:
    public = {name for name in vars(astage) if not name.startswith("_")} - {"cli", "dcp"}
    modules = {name for name in public if inspect.ismodule(getattr(astage, name))}
    assert set(astage.__all__) - {"__version__"} == public - modules
    assert list(astage.__all__) == sorted(astage.__all__)


def test_every_public_name_is_documented() -> None:
    for name in astage.__all__:
        obj = getattr(astage, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"astage.{name} has no docstring"


def test_errors_share_one_root() -> None:
    errors = [getattr(astage, n) for n in astage.__all__ if n.endswith("Error")]
    assert len(errors) >= 8
    assert all(issubclass(e, astage.AstageError) for e in errors)
