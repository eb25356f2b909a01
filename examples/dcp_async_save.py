"""An async training loop that checkpoints with torch.distributed.checkpoint through astage.

Every few steps ``await astage.dcp.async_save(...)`` returns as soon as the state is staged
(the next step may change the weights at once), while DCP writes the staged copy in a
thread; the event loop keeps serving other tasks meanwhile (here: a heartbeat that reports
how late it woke up while ``async_save`` staged; the training steps are not counted).  At
the end the last checkpoint is loaded back into a fresh model and optimizer with
``torch.distributed.checkpoint.load`` and compared.

Run: ``python examples/dcp_async_save.py [--steps N] [--every K] [--directory DIR]``, or on
several ranks with ``torchrun --nproc-per-node 2 examples/dcp_async_save.py --directory DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _lag import SaveLag
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import astage
import astage.dcp


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def checkpoint_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd, "meta": {"step": step}}


def say(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message)


async def uploaded(handle: astage.dcp.AsyncSaveHandle, step: int, started: float) -> None:
    await handle.wait()
    say(f"step {step}: written to {handle.checkpoint_id} in {time.perf_counter() - started:.3f}s")


async def train(steps: int, every: int, directory: Path) -> None:
    torch.manual_seed(0)  # every rank trains the same replica, as data-parallel ranks do
    model, opt = make_model()
    lag = SaveLag()
    beat = asyncio.create_task(lag.run())
    last: Path | None = None
    pending: tuple[astage.dcp.AsyncSaveHandle, int, float] | None = None
    async with astage.DefaultStager() as stager:  # one stager: its buffers serve every save
        for step in range(1, steps + 1):
            x = torch.randn(64, 256)
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % every == 0 or step == steps:
                if pending is not None:  # one save at a time: DCP's collectives must not interleave
                    await uploaded(*pending)
                last = directory / f"step-{step:06d}"
                started = time.perf_counter()
                with lag.measuring():
                    handle = await astage.dcp.async_save(
                        checkpoint_state(model, opt, step), checkpoint_id=last, stager=stager
                    )
                say(f"step {step}: staged in {handle.staging_seconds * 1e3:.1f} ms, training goes on")
                pending = (handle, step, started)
            await asyncio.sleep(0)  # a real trainer awaits data loading here
        if pending is not None:
            await uploaded(*pending)
    beat.cancel()
    say(lag.summary("async_save()"))
    assert last is not None
    await asyncio.to_thread(check_restore, model, opt, last, steps)


def check_restore(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path, step: int) -> None:
    fresh_model, fresh_opt = make_model()
    # The optimizer needs its state created before DCP can load into it.
    fresh_model(torch.zeros(1, 256)).sum().backward()
    fresh_opt.step()
    target = checkpoint_state(fresh_model, fresh_opt, -1)
    dcp.load(target, checkpoint_id=path)
    set_state_dict(fresh_model, fresh_opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    assert target["meta"]["step"] == step
    want, got = checkpoint_state(model, opt, step), checkpoint_state(fresh_model, fresh_opt, step)
    assert same(want["model"], got["model"]), "model differs"
    assert same(want["optim"], got["optim"]), "optimizer differs"
    say(f"restored {path.name}: model and optimizer equal to the trained ones")


def same(a: Any, b: Any) -> bool:
    """Equal trees, tensors compared exactly."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    """torchrun's group when launched by it, else a one-process gloo group."""
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every K steps (default 5)")
    parser.add_argument("--directory", type=Path, help="where checkpoints go (default: a temporary one)")
    args = parser.parse_args()
    with process_group(), contextlib.ExitStack() as stack:
        directory = args.directory or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        asyncio.run(train(args.steps, args.every, directory))


if __name__ == "__main__":
    main()
