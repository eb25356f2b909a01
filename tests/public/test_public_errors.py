"""A public call raises the astage exception its docstring names, never an ExceptionGroup.

anyio's task groups wrap what fails inside them in an ``ExceptionGroup`` (always under
trio); ``except UnsupportedInputError`` must still catch a refused value wherever astage
runs a task group on the way.  Real gloo groups of 2 processes, under asyncio and trio.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import astage
from astage import UnsupportedInputError
from astage._util.errors import one_error
from tests.distributed import run_group


@dataclasses.dataclass(frozen=True)
class Frozen:
    """Staged as it is, but no checkpoint file can hold it."""

    x: int


UNSTAGEABLE = {"w": torch.ones(3), "bad": torch.empty(3, device="meta")}
UNSTORABLE = {"w": torch.ones(3), "bad": Frozen(1)}


async def outcome(call: Any) -> str:
    """The exact type raised by ``await call()`` and its key path, or ``"ok"``."""
    try:
        await call()
    except UnsupportedInputError as exc:
        return f"{type(exc).__name__} {exc.key_path}"
    except BaseException as exc:  # an ExceptionGroup lands here
        return f"{type(exc).__name__}: {exc}"
    return "ok"


async def replication_target(rank: int, world: int, root: str) -> dict[str, str]:
    storage = Path(root) / f"rank{rank}"
    results: dict[str, str] = {}
    async with astage.ReplicationStager(storage_dir=storage / "replicas", timeout=30) as rs:
        results["replicate unstageable"] = await outcome(lambda: rs.replicate(UNSTAGEABLE, step=1))
        results["stage unstageable"] = await outcome(lambda: rs.stage(UNSTAGEABLE))
        results["replicate unstorable"] = await outcome(lambda: rs.replicate(UNSTORABLE, step=1))
        results["stage unstorable"] = await outcome(lambda: rs.stage(UNSTORABLE))
        # Nothing of those reached the wire: the group is still in step.
        done = await rs.replicate({"w": torch.full((4,), float(rank))}, step=2)
        results["then"] = str(done.replica["w"].tolist())
        async with astage.Checkpointer(storage / "ckpt", replication=rs) as ckpt:
            results["save unstageable"] = await outcome(lambda: ckpt.save(3, UNSTAGEABLE))
            results["save unstorable"] = await outcome(lambda: ckpt.save(3, UNSTORABLE))
    return results


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_replication_raises_the_refusal_itself_not_a_group(tmp_path: Path, backend: str) -> None:
    for rank, result in enumerate(
        run_group(2, replication_target, str(tmp_path), backend=backend, timeout=90)
    ):
        value = result.unwrap()
        for name in ("replicate", "stage", "save"):
            assert value[f"{name} unstageable"] == "UnsupportedInputError ('bad',)", value
            assert value[f"{name} unstorable"] == "UnsupportedInputError ('bad',)", value
        assert value["then"] == str([float(1 - rank)] * 4)


@pytest.mark.anyio
async def test_stager_checkpointer_and_dcp_raise_the_refusal_itself(tmp_path: Path) -> None:
    import astage.dcp

    async with astage.DefaultStager() as stager:
        assert await outcome(lambda: stager.stage(UNSTAGEABLE)) == "UnsupportedInputError ('bad',)"
    async with astage.Checkpointer(tmp_path / "ckpt") as ckpt:
        assert await outcome(lambda: ckpt.save(1, UNSTAGEABLE)) == "UnsupportedInputError ('bad',)"
        assert await outcome(lambda: ckpt.save(1, UNSTORABLE)) == "UnsupportedInputError ('bad',)"
    refused = await outcome(lambda: astage.dcp.async_save(UNSTAGEABLE, checkpoint_id=tmp_path / "dcp"))
    assert refused == "UnsupportedInputError ('bad',)"


class Boom(Exception):
    pass


async def fail_when_cancelled() -> None:
    try:
        await anyio.sleep_forever()
    finally:
        raise Boom("the other task")


async def two_failures() -> None:
    """A task group whose body and whose task both fail: a group of two."""
    with one_error():
        async with anyio.create_task_group() as tg:
            tg.start_soon(fail_when_cancelled)
            await anyio.wait_all_tasks_blocked()
            raise UnsupportedInputError(("k",), "refused")


@pytest.mark.anyio
async def test_one_error_raises_the_astage_error_of_a_group_with_the_others_as_notes() -> None:
    with pytest.raises(UnsupportedInputError) as info:  # not the first in the group
        await two_failures()
    assert info.value.key_path == ("k",)
    assert info.value.__notes__ == ["also failed meanwhile: Boom: the other task"]
    assert not isinstance(info.value.__context__, BaseExceptionGroup)


@pytest.mark.anyio
async def test_one_error_leaves_a_cancellation_to_its_scope() -> None:
    with anyio.CancelScope() as scope, one_error():
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.sleep_forever)
            await anyio.wait_all_tasks_blocked()
            scope.cancel()
            await anyio.sleep_forever()
    assert scope.cancelled_caught


async def fail_in_body(error: BaseException) -> None:
    with one_error():
        async with anyio.create_task_group():
            raise error


@pytest.mark.anyio
async def test_one_error_raises_an_error_of_the_body_as_it_is() -> None:
    cause = OSError("disk")
    error = astage.PersistError("write failed")
    error.__cause__ = cause
    with pytest.raises(astage.PersistError) as info:
        await fail_in_body(error)
    assert info.value is error
    assert info.value.__cause__ is cause


HUGE = 10**5000
"""An int key Python refuses to print (past its 4,300-digit limit): ``repr`` raises ValueError."""


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("state_dict", "path"),
    [
        ({HUGE: torch.zeros(1)}, ()),  # staged, but no file holds the key
        ({"a": {HUGE: {"b": threading.Lock()}}}, ("a", HUGE, "b")),  # refused below the key
    ],
)
async def test_a_key_python_cannot_print_is_named_not_a_raw_value_error(
    tmp_path: Path, state_dict: dict[Any, Any], path: tuple[Any, ...]
) -> None:
    async with astage.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(UnsupportedInputError) as info:
            await (await ckpt.save(1, state_dict)).wait()
    assert info.value.key_path == path
    assert f"<int of {HUGE.bit_length()} bits>" in str(info.value)
