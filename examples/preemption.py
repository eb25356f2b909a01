"""Save on preemption: on SIGTERM, save now and wait until the step is on the object store.

A scheduler that preempts a job sends SIGTERM and gives it a grace period before SIGKILL.
The training loop here listens for the signal in a task of its own (an anyio signal
receiver: the handler runs on the event loop, not in a signal context) and, at the end of
the step in progress, calls ``Checkpointer.save_now_and_upload(step, state, deadline=...)``,
which saves, waits for the local commit and for the upload (data object, then this rank's
commit object), all within the deadline.  Routine saves go to the local disk every
``--every`` steps and up to the store every ``Remote(every=...)``-th of them.

Run: ``python examples/preemption.py --remote file:///tmp/astage-store`` and press
Ctrl-C or ``kill -TERM <pid>``; run it again and it resumes from the store, on any machine.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile

import anyio
import torch

import astage


async def watch_for_preemption(preempted: anyio.Event) -> None:
    """Set ``preempted`` when SIGTERM (or SIGINT) arrives."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            print(f"received {signal.Signals(signum).name}: saving at the end of this step", flush=True)
            preempted.set()
            return


async def train(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters())
    remote = astage.remote.Remote(args.remote, every=args.upload_every, keep=astage.retention.latest(2))
    preempted = anyio.Event()
    async with (
        astage.Checkpointer(args.directory, keep=astage.retention.latest(2), remote=remote) as ckpt,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(watch_for_preemption, preempted)
        start = 0
        try:
            restored = await ckpt.restore()
            model.load_state_dict(restored["model"])
            opt.load_state_dict(restored["optim"])
            start = restored["step"] + 1
            print(f"resumed from step {restored['step']}", flush=True)
        except astage.ResourceError:
            print("no checkpoint on any tier: starting afresh", flush=True)
        print("training", flush=True)
        for step in range(start, start + args.steps):
            x = torch.randn(32, 256)
            loss = (model(x) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
            if preempted.is_set():
                stats = await ckpt.save_now_and_upload(step, state, deadline=args.deadline)
                print(
                    f"uploaded step {step}: {stats.nbytes / 1e6:.1f} MB in {stats.seconds:.2f}s "
                    f"({stats.gbps:.2f} GB/s); exiting",
                    flush=True,
                )
                tg.cancel_scope.cancel()
                return 0
            if step % args.every == 0:
                await ckpt.save(step, state, metrics={"loss": float(loss)})
            await anyio.sleep(args.step_seconds)  # a real trainer awaits its data loader here
        tg.cancel_scope.cancel()
    print("finished without preemption", flush=True)
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--remote", default=None, help="store URL (default: a temporary file:// store)")
    parser.add_argument("--directory", default=None, help="local checkpoint directory (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=10, help="save locally every N steps")
    parser.add_argument("--upload-every", type=int, default=5, help="upload every N-th local save")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds for the save on preemption")
    parser.add_argument("--step-seconds", type=float, default=0.01)
    args = parser.parse_args()
    if args.remote is None:
        args.remote = f"file://{tempfile.mkdtemp(prefix='astage-store-')}"
    if args.directory is None:
        args.directory = tempfile.mkdtemp(prefix="astage-local-")
    sys.exit(anyio.run(train, args))


if __name__ == "__main__":
    main()
