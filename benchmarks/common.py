"""Helpers shared by the benchmarks: state_dict builders, timing, loop lag, peak RSS, tables.

Every benchmark compares astage with a ceiling and with torch on the same inputs, so the
inputs are built here once: a GPT-2-small-shaped model with Adam state and a tree of many
small tensors.  Sizes take a ``scale`` (1.0 = the sizes the issues name) so the same code
serves a smoke test and a full run.  Memory is measured as the growth of the process's
peak RSS over a baseline, so that building the inputs does not count against a method.
"""

from __future__ import annotations

import asyncio
import datetime
import math
import os
import platform
import re
import resource
import statistics
import time
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any, Self

import torch

SCALE_ENV = "ASTAGE_BENCH_SCALE"
"""Environment variable holding the default size scale (1.0 = full size)."""


def default_scale() -> float:
    """The size scale from :data:`SCALE_ENV`, or 1.0."""
    return float(os.environ.get(SCALE_ENV, "1.0"))


# -- state_dicts --------------------------------------------------------------------------


def _filled(*shape: int, value: float) -> torch.Tensor:
    # fill_ touches every page without the temporaries of randn, so building the input
    # does not raise the peak RSS above what the input itself holds.
    return torch.empty(*shape).fill_(value)


def gpt2_adam_state_dict(scale: float = 1.0) -> dict[str, Any]:
    """A GPT-2-small-shaped checkpoint: fp32 weights plus Adam ``exp_avg``/``exp_avg_sq``/``step``.

    At ``scale=1`` the shapes are GPT-2 small's (124M parameters, ~1.5 GB with Adam state);
    other scales keep the 12 blocks and shrink width, vocabulary and context by
    ``sqrt(scale)``, so bytes scale linearly and the tensor count stays the same.
    ``lm_head.weight`` is tied to ``transformer.wte.weight`` (one storage, as in GPT-2).
    """
    k = math.sqrt(scale)
    d = max(8, round(768 * k / 8) * 8)
    vocab, ctx = max(16, round(50257 * k)), max(8, round(1024 * k))
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (vocab, d),
        "transformer.wpe.weight": (ctx, d),
    }
    for i in range(12):
        p = f"transformer.h.{i}."
        shapes |= {
            p + "ln_1.weight": (d,),
            p + "ln_1.bias": (d,),
            p + "attn.c_attn.weight": (d, 3 * d),
            p + "attn.c_attn.bias": (3 * d,),
            p + "attn.c_proj.weight": (d, d),
            p + "attn.c_proj.bias": (d,),
            p + "ln_2.weight": (d,),
            p + "ln_2.bias": (d,),
            p + "mlp.c_fc.weight": (d, 4 * d),
            p + "mlp.c_fc.bias": (4 * d,),
            p + "mlp.c_proj.weight": (4 * d, d),
            p + "mlp.c_proj.bias": (d,),
        }
    shapes |= {"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
    model = {name: _filled(*shape, value=0.01) for name, shape in shapes.items()}
    model["lm_head.weight"] = model["transformer.wte.weight"]
    state = {
        i: {
            "step": torch.tensor(100.0),
            "exp_avg": _filled(*shape, value=1e-3),
            "exp_avg_sq": _filled(*shape, value=1e-6),
        }
        for i, shape in enumerate(shapes.values())
    }
    group = {"lr": 6e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False}
    return {"model": model, "optim": {"state": state, "param_groups": [group | {"params": list(state)}]}}


def small_tensors_state_dict(scale: float = 1.0, count: int = 20_000) -> dict[str, Any]:
    """``count * scale`` fp32 tensors of 16-256 elements, 200 to a sub-dict."""
    n = max(10, round(count * scale))
    sizes = torch.randint(16, 257, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    tree: dict[str, Any] = {}
    for i, size in enumerate(sizes):
        tree.setdefault(f"layer{i // 200:03d}", {})[f"p{i % 200:03d}"] = _filled(size, value=float(i))
    return tree


def dtensor_state_dict(scale: float = 1.0) -> dict[str, Any]:
    """:func:`small_tensors_state_dict` as DTensors sharded on dim 0 over a one-rank mesh, the
    shape of an FSDP2 ``get_state_dict``; joins a one-rank gloo group over an in-process
    store if this process has no group yet."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    placements = [Shard(0)]
    return {
        layer: {name: DTensor.from_local(t, mesh, placements) for name, t in tensors.items()}
        for layer, tensors in small_tensors_state_dict(scale).items()
    }


def trainer_state_dict(scale: float = 1.0) -> dict[str, Any]:
    """:func:`small_tensors_state_dict` with what a training loop saves beside its tensors:
    a step count, a scheduled learning rate and a loss, which :func:`trainer_step` changes."""
    return small_tensors_state_dict(scale) | {"trainer": {"step": 0, "lr": 1e-3, "loss": 2.5}}


def trainer_step(tree: dict[str, Any]) -> None:
    """One step of a :func:`trainer_state_dict`'s scalars: the step, a decayed rate, a new loss."""
    state = tree["trainer"]
    state["step"] += 1
    state["lr"] = 1e-3 * 0.999 ** state["step"]
    state["loss"] = 2.5 / (1 + state["step"])


MOE_EXPERTS, MOE_LAYERS, MOE_DIM, MOE_HIDDEN = 64, 35, 64, 128
"""At ``scale=1``: 64 experts x 35 layers x 3 weights (64x128) x (weight + 2 Adam states)."""


def moe_adam_state_dict(scale: float = 1.0) -> dict[str, Any]:
    """A mixture-of-experts checkpoint: experts x layers x 3 fp32 weights, each with Adam state.

    Each (layer, expert) holds ``w1``/``w3`` (dim x hidden) and ``w2`` (hidden x dim), and the
    optimizer an ``exp_avg`` and ``exp_avg_sq`` per weight: 9 tensors of 32 KiB.  At
    ``scale=1`` that is 64 x 35 pairs, 20,160 tensors, 0.66 GB; ``scale`` shrinks the number
    of pairs (at least one), so the per-tensor size, and the per-tensor cost it exposes, stay.
    """
    pairs = max(1, round(MOE_EXPERTS * MOE_LAYERS * scale))
    shapes = {"w1": (MOE_DIM, MOE_HIDDEN), "w2": (MOE_HIDDEN, MOE_DIM), "w3": (MOE_DIM, MOE_HIDDEN)}
    model: dict[str, torch.Tensor] = {}
    for i in range(pairs):
        layer, expert = divmod(i, MOE_EXPERTS)
        for w, shape in shapes.items():
            model[f"layers.{layer}.moe.experts.{expert}.{w}"] = _filled(*shape, value=0.01)
    state = {
        i: {"exp_avg": _filled(*t.shape, value=1e-3), "exp_avg_sq": _filled(*t.shape, value=1e-6)}
        for i, t in enumerate(model.values())
    }
    return {"model": model, "optim": {"state": state, "param_groups": [{"lr": 1e-4, "params": list(state)}]}}


LORA_FROZEN_FRACTION = 0.95
"""Share of a LoRA checkpoint's bytes in frozen base weights."""


def lora_state_dict(scale: float = 1.0) -> dict[str, Any]:
    """A LoRA fine-tuning checkpoint: frozen GPT-2-small weights, trainable adapters with Adam state.

    Every 2-D block weight (in x out) gets ``lora_A`` (in x r) and ``lora_B`` (r x out), each
    with ``exp_avg``/``exp_avg_sq``; the rank ``r`` is chosen so that the adapters and their
    optimizer state are :data:`LORA_FROZEN_FRACTION`'s complement (5%) of the bytes.  The
    base weights have no optimizer state (frozen).  :func:`lora_trainable` names what a
    training step changes.  ~0.52 GB at ``scale=1``.
    """
    base = gpt2_adam_state_dict(scale)["model"]
    targets = {k: t for k, t in base.items() if k.startswith("transformer.h.") and t.dim() == 2}
    frozen = sum(t.untyped_storage().nbytes() for t in distinct_storages(base))
    per_rank = 3 * 4 * sum(t.shape[0] + t.shape[1] for t in targets.values())  # A+B, 2 Adam states
    r = max(1, round(frozen * (1 - LORA_FROZEN_FRACTION) / LORA_FROZEN_FRACTION / per_rank))
    adapters: dict[str, torch.Tensor] = {}
    for k, t in targets.items():
        stem = k.removesuffix(".weight")
        adapters[stem + ".lora_A"] = _filled(t.shape[0], r, value=0.01)
        adapters[stem + ".lora_B"] = _filled(r, t.shape[1], value=0.0)
    state = {
        i: {"exp_avg": _filled(*t.shape, value=1e-3), "exp_avg_sq": _filled(*t.shape, value=1e-6)}
        for i, t in enumerate(adapters.values())
    }
    group = {"lr": 1e-4, "params": list(state)}
    return {"model": base | adapters, "optim": {"state": state, "param_groups": [group]}}


def lora_trainable(tree: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors of a :func:`lora_state_dict` that a training step writes: adapters, Adam state."""
    adapters = [t for k, t in tree["model"].items() if ".lora_" in k]
    return adapters + [t for s in tree["optim"]["state"].values() for t in s.values()]


def train_step(tensors: Sequence[torch.Tensor]) -> None:
    """Write every tensor in place, as an optimizer step does (bumps each ``_version``)."""
    with torch.no_grad():
        for t in tensors:
            t.add_(1e-3)


def iter_tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor leaf of nested dicts, lists and tuples, in order (repeats included); a
    DTensor as its local tensor (what holds its bytes)."""
    if isinstance(tree, torch.Tensor):
        yield getattr(tree, "_local_tensor", tree)
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from iter_tensors(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from iter_tensors(value)


def distinct_storages(tree: Any) -> list[torch.Tensor]:
    """One tensor per distinct storage (tied weights count once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in iter_tensors(tree):
        seen.setdefault(t.untyped_storage().data_ptr(), t)
    return list(seen.values())


def nbytes(tree: Any) -> int:
    """Bytes held by the distinct storages of ``tree``: what a stage has to copy."""
    return sum(t.untyped_storage().nbytes() for t in distinct_storages(tree))


# -- statistics ---------------------------------------------------------------------------

clock = time.perf_counter


def median(values: Sequence[float]) -> float:
    """The median, or NaN for no values."""
    return statistics.median(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank), or NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# -- event-loop lag -----------------------------------------------------------------------


class LoopLag:
    """Measure event-loop lag while the block runs: a heartbeat task sleeping ``period``.

    Each wake-up records ``actual - expected`` in seconds in :attr:`samples`, and when it
    happened (seconds since the block began) in :attr:`times`; a heartbeat still overdue
    when the block ends (the loop was blocked until then) records its lag too.
    """

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.samples: list[float] = []
        self.times: list[float] = []
        self._start = clock()
        self._expected: float | None = None
        self._task: asyncio.Task[None] | None = None

    async def _beat(self) -> None:
        while True:
            self._expected = clock() + self.period
            await asyncio.sleep(self.period)
            self._record()
            self._expected = None

    def _record(self) -> None:
        assert self._expected is not None
        now = clock()
        self.samples.append(now - self._expected)
        self.times.append(now - self._start)

    async def __aenter__(self) -> Self:
        self._start = clock()
        self._task = asyncio.create_task(self._beat())
        await asyncio.sleep(0)  # let the heartbeat start before the measured work
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._expected is not None and clock() > self._expected:
            self._record()
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def idle_lag(seconds: float = 0.3) -> list[float]:
    """Lag samples of an idle loop: the floor the measured lags sit on."""
    async with LoopLag() as lag:
        await asyncio.sleep(seconds)
    return lag.samples


def environment() -> dict[str, Any]:
    """What a result was measured on: versions, CPU count, platform and date (for the JSON)."""
    import astage

    return {
        "astage": astage.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "accelerator": str(torch.accelerator.current_accelerator() or "none"),
        "date": datetime.date.today().isoformat(),
    }


# -- memory -------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            found = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) if found else None


class PeakRss:
    """Growth of this process's peak RSS since construction, in bytes.

    On Linux the kernel's peak (``VmHWM``) is reset first, so a method run after other work
    in the same process is charged only for what it adds over the current RSS; elsewhere
    ``ru_maxrss`` is used and the method should run in a fresh process.
    """

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "5" resets the peak RSS to the current RSS
        except OSError:
            pass
        self._base = _status_kib("VmRSS") or self._maxrss_kib()

    @staticmethod
    def _maxrss_kib() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def growth(self) -> int:
        """Bytes the peak RSS rose above the RSS at construction."""
        peak = _status_kib("VmHWM") or self._maxrss_kib()
        return max(0, peak - self._base) * 1024


# -- output -------------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])
