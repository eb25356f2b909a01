"""The public surface: small, explicit, documented, and exactly the names decided on."""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from pathlib import Path

import pytest

import astage

# The decided surface; docs/api.rst says why each name is here.  A name added to
# or dropped from astage.__all__ must be added or dropped here and explained there.
PUBLIC = {
    # staging
    "AsyncStager",
    "BlockingStager",
    "DefaultStager",
    "PoolStats",
    "StageStats",
    "StagingOptions",
    # checkpointing
    "Checkpointer",
    "ReplicaSource",
    "Replicator",
    "SaveEvent",
    "SaveHandle",
    "SaveStats",
    "FillReport",
    # replication
    "ReplicationPhase",
    "ReplicationResult",
    "ReplicationStager",
    "ReplicationStats",
    # errors
    "AstageError",
    "CapacityError",
    "ClosedError",
    "ConfigurationError",
    "DestinationMismatchError",
    "EventLoopError",
    "IntegrityError",
    "PeerReportedError",
    "PeerTimeoutError",
    "PersistError",
    "RemoteError",
    "ResourceError",
    "TransportError",
    "UnsupportedInputError",
}

# The file readers' room: a public submodule, so that the top level stays a short list.
FILES = {
    "CheckpointFileInfo",
    "find_replicas",
    "inspect_checkpoint_file",
    "load_checkpoint_file",
    "load_checkpoint_file_sync",
    "sweep_stale_temps",
}

# Exported once, no longer: each still resolves from astage, silently, outside __all__.
RETIRED = {"BufferPool": "astage._staging.pool", "BufferKind": "astage._staging.pool"}
RETIRED |= dict.fromkeys(FILES, "astage.files")

# Rooms a program opens when it needs them: each name also resolves from astage, outside __all__.
ROOMS = {
    "astage.events": {"wait_event"},
    "astage.remote": {"Remote", "UploadStats"},
    "astage.retention": {"Policy", "StepInfo", "best", "every_seconds", "every_steps", "keep_if", "latest"},
}
for room, names in ROOMS.items():
    RETIRED |= dict.fromkeys(names, room)

API_DOCS = Path(__file__).resolve().parents[2] / "docs" / "api.rst"


def test_all_is_exactly_the_decided_surface() -> None:
    assert set(astage.__all__) == PUBLIC | {"__version__"}
    assert list(astage.__all__) == sorted(astage.__all__)
    assert len(astage.__all__) <= 32


def test_the_file_readers_have_a_public_room_of_their_own() -> None:
    import astage.files

    assert set(astage.files.__all__) == FILES
    for name in FILES:
        assert inspect.getdoc(getattr(astage.files, name)), f"astage.files.{name} has no docstring"


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_each_public_room_exports_exactly_its_names_with_docstrings(room: str) -> None:
    module = importlib.import_module(room)
    assert set(module.__all__) == ROOMS[room]
    for name in module.__all__:
        assert inspect.getdoc(getattr(module, name)), f"{room}.{name} has no docstring"


def test_all_lists_exactly_the_public_names() -> None:
    public = {name for name in vars(astage) if not name.startswith("_")}
    public -= {"cli", "dcp", "events", "files", "remote", "retention"}
    modules = {name for name in public if inspect.ismodule(getattr(astage, name))}
    assert set(astage.__all__) - {"__version__"} == public - modules


def test_every_public_name_is_documented() -> None:
    for name in astage.__all__:
        obj = getattr(astage, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert inspect.getdoc(obj), f"astage.{name} has no docstring"


def test_the_api_docs_say_why_each_name_is_public_or_not() -> None:
    section = API_DOCS.read_text().split("What is public and why", 1)[1].split("\nReference\n", 1)[0]
    named = set(re.findall(r"``(\w+)", section))
    assert PUBLIC - {n for n in PUBLIC if n.endswith("Error")} <= named
    assert "AstageError" in named
    assert set(RETIRED) <= named


@pytest.mark.parametrize("name", sorted(RETIRED))
def test_a_retired_name_still_resolves_silently_but_is_not_public(name: str) -> None:
    module = importlib.import_module(RETIRED[name])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        obj = getattr(astage, name)
    assert obj is getattr(module, name)
    assert name not in astage.__all__
    assert name not in dir(astage)


def test_a_public_name_resolves_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in astage.__all__:
            getattr(astage, name)


# The 0.1.0 names of the file readers: aliases of the names above, removed rather than kept.
REMOVED = ("ReplicaInfo", "inspect_replica", "load_replica", "load_replica_sync")


@pytest.mark.parametrize("name", REMOVED)
def test_the_first_release_aliases_of_the_file_readers_are_gone(name: str) -> None:
    assert name not in astage.__all__
    with pytest.raises(AttributeError, match=name):
        getattr(astage, name)
    assert not hasattr(importlib.import_module("astage._files.durable"), name)


def test_the_api_docs_name_the_removed_aliases() -> None:
    section = API_DOCS.read_text().split("Not public any more", 1)[1].split("\nReference\n", 1)[0]
    assert set(REMOVED) <= set(re.findall(r"``(\w+)", section))


def test_no_public_callable_takes_a_private_argument() -> None:
    # A knob for astage's own use (an underscore name) does not belong on a signature users
    # read, call and type-check against: constructors, public methods and functions alike.
    for name in astage.__all__:
        obj = getattr(astage, name)
        if inspect.isclass(obj):
            if issubclass(obj, BaseException):
                continue
            public = [a for a in dir(obj) if not a.startswith("_")]
            callables = [obj, *(getattr(obj, a) for a in public if inspect.isroutine(getattr(obj, a)))]
        elif callable(obj):
            callables = [obj]
        else:
            continue
        for item in callables:
            try:
                parameters = inspect.signature(item).parameters
            except (TypeError, ValueError):  # no signature to read
                continue
            private = [p for p in parameters if p.startswith("_")]
            assert not private, f"astage.{name}: {getattr(item, '__qualname__', item)} takes {private}"


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'BufferPools'"):
        _ = astage.BufferPools  # type: ignore[attr-defined]


def test_errors_share_one_root() -> None:
    errors = [getattr(astage, n) for n in astage.__all__ if n.endswith("Error")]
    assert len(errors) >= 8
    assert all(issubclass(e, astage.AstageError) for e in errors)
