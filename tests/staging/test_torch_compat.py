"""Meeting torch users where they are: astage stagers handed to torch's ``dcp.async_save``
fail at once with the fix in the message, and torch's ``StagingOptions`` (positional or
``config=``) map one to one onto astage's."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import StagingOptions as TorchStagingOptions

import astage
from astage import ConfigurationError
from astage._staging.options import accelerator_available
from tests.distributed import run_group

needs_no_accelerator = pytest.mark.skipif(
    accelerator_available(), reason="checks the refusal of accelerator features without one"
)


def _torch_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("AsyncCheckpointExecutor")}


@pytest.mark.parametrize("make", [astage.DefaultStager, astage.BlockingStager], ids=["default", "blocking"])
def test_torch_async_save_with_an_astage_stager_fails_at_once_naming_the_adapter(
    tmp_path: Path, make: type[astage.DefaultStager]
) -> None:
    stager = make()
    before = _torch_threads()
    with pytest.raises(ConfigurationError, match=r"astage\.dcp\.StagerAdapter") as caught:
        dcp.async_save({"w": torch.ones(4)}, checkpoint_id=tmp_path / "ckpt", async_stager=stager)
    assert isinstance(caught.value, TypeError)  # the wrong kind of object was handed to torch
    assert _torch_threads() == before, "torch started an upload of something that is not a state_dict"
    assert not (tmp_path / "ckpt").exists()

    async def still_usable() -> Any:
        async with stager:
            return await stager.stage({"w": torch.ones(4)})

    assert torch.equal(anyio.run(still_usable)["w"], torch.ones(4))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_the_adapter_named_in_the_error_works_with_torch_options(tmp_path: Path) -> None:
    options = TorchStagingOptions(False, False, True, False)
    state = {"w": torch.arange(12.0).view(3, 4), "step": 7}
    with astage.dcp.StagerAdapter(astage.DefaultStager(config=options)) as adapter:
        response = dcp.async_save(state, checkpoint_id=tmp_path / "ckpt", async_stager=adapter)
        response.upload_completion.result()
    loaded = {"w": torch.zeros(3, 4), "step": 0}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt")
    assert torch.equal(loaded["w"], state["w"])
    assert loaded["step"] == 7


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"stager": TorchStagingOptions(False, False, True, False)}, "stager"),
        ({"stager": "default"}, "stager"),
        ({"close_stager": "no"}, "close_stager"),  # truthy: it would close a stager it does not own
        ({"close_stager": None}, "close_stager"),
    ],
)
def test_the_adapter_refuses_bad_arguments_naming_them(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        astage.dcp.StagerAdapter(**kwargs)


SWITCHES = list(itertools.product([False, True], repeat=2))


@pytest.mark.parametrize(("shared", "use_async"), SWITCHES)
@pytest.mark.parametrize("keyword", ["positional", "config", "options"])
def test_torch_staging_options_map_one_to_one(shared: bool, use_async: bool, keyword: str) -> None:
    theirs = TorchStagingOptions(
        use_pinned_memory=False,
        use_shared_memory=shared,
        use_async_staging=use_async,
        use_non_blocking_copy=False,
    )
    if keyword == "positional":
        stager = astage.DefaultStager(theirs)
    else:
        stager = astage.DefaultStager(**{keyword: theirs})
    assert stager.options == astage.StagingOptions(
        use_pinned_memory=False,
        use_shared_memory=shared,
        use_async_staging=use_async,
        use_non_blocking_copy=False,
    )
    assert astage.StagingOptions.from_torch(theirs) == stager.options

    async def stage() -> Any:
        async with stager:
            return await stager.stage({"w": torch.arange(6.0)})

    staged = anyio.run(stage)
    assert torch.equal(staged["w"], torch.arange(6.0))
    assert staged["w"].is_shared() == shared


def test_astage_options_under_torchs_config_keyword() -> None:
    ours = astage.StagingOptions(use_async_staging=False, max_staging_bytes=1 << 20)
    assert astage.DefaultStager(config=ours).options is ours


@needs_no_accelerator
@pytest.mark.parametrize(
    ("theirs", "named"),
    [
        (TorchStagingOptions(), "use_pinned_memory=True and use_non_blocking_copy=True"),
        (TorchStagingOptions(True, False, False, False), "use_pinned_memory=True"),
        (TorchStagingOptions(False, False, False, True), "use_non_blocking_copy=True"),
    ],
)
def test_torch_accelerator_switches_without_an_accelerator_say_what_to_do(
    theirs: TorchStagingOptions, named: str
) -> None:
    with pytest.raises(ConfigurationError, match=named) as caught:
        astage.DefaultStager(config=theirs)
    assert "astage.StagingOptions()" in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"options": astage.StagingOptions(), "config": astage.StagingOptions()}, "options or config"),
        ({"options": {"use_shared_memory": True}}, "options must be"),
        ({"config": "pinned"}, "config must be"),
        ({"config": TorchStagingOptions(False, 1, True, False)}, "use_shared_memory"),  # type: ignore[arg-type]
        ({"config": TorchStagingOptions(False, False, None, False)}, "use_async_staging"),  # type: ignore[arg-type]
    ],
)
def test_options_that_cannot_map_are_refused_naming_them(kwargs: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        astage.DefaultStager(**kwargs)


def test_from_torch_refuses_anything_else() -> None:
    with pytest.raises(ConfigurationError, match=r"torch\.distributed\.checkpoint\.staging\.StagingOptions"):
        astage.StagingOptions.from_torch(astage.StagingOptions())  # type: ignore[arg-type]


async def replication_target(rank: int, world: int, root: str) -> dict[str, Any]:
    theirs = TorchStagingOptions(False, False, True, False)
    state = {"w": torch.full((4,), float(rank))}
    async with astage.ReplicationStager(
        storage_dir=Path(root) / f"rank{rank}", timeout=20, options=theirs
    ) as rs:
        mapped = rs.stager.options == astage.StagingOptions.from_torch(theirs)
        try:
            dcp.async_save(state, checkpoint_id=Path(root) / "dcp", async_stager=rs)
        except ConfigurationError as exc:
            refused = str(exc)
        else:
            refused = "accepted"
        dist.barrier()  # both ranks are past torch's refusal: no exchange is in flight
        # Unlike torch's _ReplicationStager, stage() returns this rank's own copy.
        staged = await rs.stage(state)
    return {"mapped": mapped, "refused": refused, "own": torch.equal(staged["w"], state["w"])}


def test_replication_stager_takes_torch_options_and_refuses_torchs_async_save(tmp_path: Path) -> None:
    for result in run_group(2, replication_target, str(tmp_path), timeout=60):
        value = result.unwrap()
        assert value["mapped"]
        assert "astage.dcp.StagerAdapter" in value["refused"]
        assert value["own"]
