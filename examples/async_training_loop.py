"""An async training loop that checkpoints without waiting for the copy.

``await stager.stage(sd)`` returns a CPU copy that later training steps cannot change;
meanwhile the event loop keeps serving other tasks (here: a heartbeat that reports how
late it woke up while ``stage()`` ran; the training steps themselves hold the loop and are
not counted).  Run: ``python examples/async_training_loop.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import asyncio

import torch
from _lag import SaveLag

import astage


async def train(steps: int, every: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
    opt = torch.optim.AdamW(model.parameters())
    lag = SaveLag()
    beat = asyncio.create_task(lag.run())
    async with astage.DefaultStager() as stager:
        for step in range(1, steps + 1):
            x = torch.randn(32, 512)
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % every == 0:
                with lag.measuring():
                    staged = await stager.stage({"model": model.state_dict(), "optim": opt.state_dict()})
                stats = stager.last_stats
                assert stats is not None
                print(
                    f"step {step}: staged {stats.tensors} tensors, {stats.bytes / 1e6:.1f} MB "
                    f"in {stats.seconds * 1e3:.1f} ms ({stats.bytes_allocated / 1e6:.1f} MB new)"
                )
                # ... hand `staged` to a writer task or a peer; here we just give it back.
                await stager.release(staged)
            await asyncio.sleep(0)  # a real trainer awaits data loading here
    beat.cancel()
    print(lag.summary("stage()"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    asyncio.run(train(args.steps, args.every))


if __name__ == "__main__":
    main()
