"""``astage demo``: the README's main job, on an embedded default.

Two local processes join a gloo group on 127.0.0.1 and each trains a small built-in model
on synthetic data in an async loop.  Every few steps each rank checkpoints through a
:class:`Checkpointer` whose saves are also replicated to its ring peer; each rank has a
directory of its own (no shared path, as on separate machines).  At the end the ranks
restore their latest checkpoint collectively and check it bit for bit against what they
saved; then each rank in turn loses its whole directory and the job restores again,
collectively, the lost rank receiving its state from the peer that holds its replica.
Rank 0 shows a progress bar; the parent prints a summary table.  Uses the public API only.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import socket
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import astage


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.LayerNorm(512), torch.nn.Linear(512, 256)
    )
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _same(a: Any, b: Any) -> bool:
    if isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and torch.equal(a, b)
    if isinstance(b, dict):
        return isinstance(a, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


async def _barrier() -> None:
    await asyncio.to_thread(dist.barrier)  # nothing else is on the group meanwhile


class _Trainer:
    """One rank's model, optimizer and node directory (its own "machine": nothing shared)."""

    def __init__(self, rank: int, root: Path) -> None:
        torch.manual_seed(rank)
        self.rank = rank
        self.model, self.opt = _model()
        self.node = root / f"node{rank}"

    def job(self) -> tuple[astage.ReplicationStager, astage.Checkpointer]:
        """What a (re)started job opens: replication to the ring peer, and a Checkpointer."""
        replication = astage.ReplicationStager(storage_dir=self.node / "replicas", keep=2, timeout=60)
        ckpt = astage.Checkpointer(self.node / "checkpoints", rank=self.rank, keep=2, replication=replication)
        return replication, ckpt

    def train_step(self) -> float:
        x = torch.randn(64, 256)
        loss = (self.model(x) - x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def snapshot(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The state to save, and what a restore must give back (the weights, cloned now)."""
        weights = self.model.state_dict()
        expected = {"model": {k: v.clone() for k, v in weights.items()}, "step": step}
        return {"model": weights, "optim": self.opt.state_dict(), "step": step}, expected


def _restored_as_expected(restored: dict[str, Any], expected: dict[str, Any]) -> bool:
    return _same({"model": restored["model"], "step": restored["step"]}, expected)


async def _train(
    t: _Trainer, ckpt: astage.Checkpointer, steps: int, every: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Train ``steps`` steps, saving every ``every``; the saves' rows and the last expected state."""
    saves: list[tuple[float, astage.SaveHandle]] = []
    expected: dict[str, Any] = {}
    progress = Progress(transient=True, disable=t.rank != 0)
    with progress:
        task = progress.add_task("training", total=steps)
        for step in range(1, steps + 1):
            loss = t.train_step()
            if step % every == 0:
                state, expected = t.snapshot(step)
                handle = await ckpt.save(step, state)  # returns once staged: train on
                saves.append((loss, handle))
            progress.advance(task)
            await asyncio.sleep(0)  # a real trainer awaits its data here
        await ckpt.wait()
    rows = []
    for loss_value, handle in saves:
        stats = await handle.wait()
        rows.append(
            {
                "step": stats.step,
                "loss": loss_value,
                "mb": stats.nbytes / 1e6,
                "blocked_ms": stats.staging_seconds * 1e3,
                "persist_ms": stats.persist_seconds * 1e3,
                "replicate_ms": (stats.replicate_seconds or 0.0) * 1e3,
                "gbps": stats.gbps,
            }
        )
    return rows, expected


async def _lose_each_node(t: _Trainer, world: int, step: int, expected: dict[str, Any]) -> bool:
    """Each rank in turn loses its whole node (checkpoints and the replicas it held).

    The job restarts without re-creating the process group: new objects, a collective restore
    in which the lost rank receives its state from the peer that holds its replica.  One more
    step is then trained and saved, so the next loss is survivable too.  Returns whether this
    rank, when lost, got its state back bit for bit with no file of its own.
    """
    peer_ok = False
    for lost in range(world):
        await _barrier()
        if t.rank == lost:
            shutil.rmtree(t.node)
        await _barrier()
        replication, ckpt = t.job()
        async with replication, ckpt:
            had_files = bool(ckpt.steps())
            ok = _restored_as_expected(await ckpt.restore(), expected)
            if t.rank == lost:
                peer_ok = ok and not had_files
            step += 1
            t.train_step()
            state, expected = t.snapshot(step)
            await (await ckpt.save(step, state)).wait()
    return peer_ok


async def _rank_main(rank: int, world: int, root: Path, steps: int, every: int) -> dict[str, Any]:
    t = _Trainer(rank, root)
    replication, ckpt = t.job()
    async with replication, ckpt:
        rows, expected = await _train(t, ckpt, steps, every)
        latest = ckpt.latest()
        restored = await ckpt.restore()  # collective: every rank restores the same step
        local_ok = _restored_as_expected(restored, expected)
    peer_ok = await _lose_each_node(t, world, steps, expected)
    return {"rank": rank, "latest": latest, "local_ok": local_ok, "peer_ok": peer_ok, "saves": rows}


def _child(rank: int, world: int, port: int, root: str, steps: int, every: int, out: Any) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(message)s")
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        try:
            out.put(asyncio.run(_rank_main(rank, world, Path(root), steps, every)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # report, never hang the parent
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_demo(steps: int = 24, every: int = 4, ranks: int = 2, directory: Path | None = None) -> int:
    """Run the demo; returns the process exit code (0: every check passed)."""
    console = Console()
    if ranks < 2 or steps < every or every < 1:
        raise astage.ConfigurationError("the demo needs --ranks >= 2 and 1 <= --every <= --steps")
    with tempfile.TemporaryDirectory(prefix="astage-demo-") as tmp:
        # A fresh run directory each time: re-running on the same --directory starts anew.
        if directory is not None:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="run-", dir=directory)) if directory else Path(tmp)
        console.print(
            f"astage demo: {ranks} ranks on 127.0.0.1 (gloo), each with its own node directory under {root}"
        )
        results = _run_ranks(ranks, root, steps, every)
    failed = [r for r in results if "error" in r]
    for r in failed:
        console.print(f"[red]rank {r['rank']} failed: {r['error']}[/red]")
    if failed:
        return 1
    console.print(_saves_table(results[0]["saves"]))
    checks = Table(title="restore checks (collective restore; each rank's node lost in turn)")
    for column in ("rank", "latest step", "restored locally", "node lost: restored from peer replica"):
        checks.add_column(column)
    for r in results:
        checks.add_row(str(r["rank"]), str(r["latest"]), _mark(r["local_ok"]), _mark(r["peer_ok"]))
    console.print(checks)
    ok = all(r["local_ok"] and r["peer_ok"] for r in results)
    console.print("[green]all checks passed[/green]" if ok else "[red]a restore check failed[/red]")
    return 0 if ok else 1


def _run_ranks(ranks: int, root: Path, steps: int, every: int) -> list[dict[str, Any]]:
    """Run every rank in its own process; each one's result (or error), by rank."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_child, args=(r, ranks, port, str(root), steps, every, out)) for r in range(ranks)
    ]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=300) for _ in procs), key=lambda r: r["rank"])
    for p in procs:
        p.join(timeout=60)
    return results


def _saves_table(saves: list[dict[str, Any]]) -> Table:
    table = Table(
        title="checkpoints (rank 0; every save also replicated to its peer)",
        caption=(
            "save() blocked: how long the training loop waited in save() (staging to CPU buffers); "
            "persist: encoding, writing and fsyncing the local checkpoint file in the background; "
            "GB/s: checkpoint size over persist time"
        ),
    )
    columns = ("step", "loss", "MB", "save() blocked ms", "persist ms", "replicate ms", "persist GB/s")
    for column in columns:
        table.add_column(column, justify="right")
    for row in saves:
        table.add_row(
            str(row["step"]),
            f"{row['loss']:.4f}",
            f"{row['mb']:.2f}",
            f"{row['blocked_ms']:.1f}",
            f"{row['persist_ms']:.1f}",
            f"{row['replicate_ms']:.1f}",
            f"{row['gbps']:.2f}",
        )
    return table


def _mark(ok: bool) -> str:
    return "[green]yes, bit-exact[/green]" if ok else "[red]NO[/red]"
