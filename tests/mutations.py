"""The random changes a training job (or an adversary) makes to a state_dict between two
stages, for the bit-exact property tests (:mod:`tests.snapshots` is their oracle).

:class:`World` holds a state_dict and makes, at each :meth:`World.step`, a few seeded random
changes: values written in place (directly and through views), metadata changes, aliasing
made and undone, storages freed and re-allocated (``set_``, ``.data =``,
``UntypedStorage.resize_``, ``Tensor.resize_``), keys added and removed, scalars changed and
turned into other types, inference tensors made and changed.

Writes that bump no version counter (``.data``, NumPy, ``UntypedStorage.copy_``) are left
out: ``skip_unchanged`` documents that it does not see them (docs/concepts.md).
"""

from __future__ import annotations

import collections
import random
from collections.abc import Callable
from typing import Any

import torch

from tests.statedicts import random_tensor

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool)
MAX_TENSORS = 24
MAX_SIDE = 4
"""Small tensors have at most ``MAX_SIDE ** 2`` elements of at most 8 bytes."""
EMBEDDING = 4096
"""Elements of the one large float32 tensor, which keeps its size (only its values and its
storage change): with it a state_dict's size stays close to :data:`STATE_BOUND`."""
STATE_BOUND = EMBEDDING * 4 + MAX_TENSORS * MAX_SIDE**2 * 8
CAP = STATE_BOUND * 3 // 2
"""Room for one copy, not two: a copy the stager drops without emptying it, while the
caller's variable still names it, leaves no room for the next (the driver holds no copy of
its own under the cap)."""
Slot = tuple[Any, Any]
"""A tensor's place: its container (a dict or a list) and its key there."""


class World:
    """A state_dict and the random changes made to it between stages."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.counter = 0
        base = self.tensor(2)
        model: collections.OrderedDict[str, Any] = collections.OrderedDict(
            weight=base, weight_t=base.t(), row=base[-1], bias=self.tensor(1)
        )
        model._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
        with torch.inference_mode():
            ema = torch.randn(MAX_SIDE**2, generator=self.gen)
        self.sd: dict[str, Any] = {
            "embedding": random_tensor((EMBEDDING,), torch.float32, self.gen),
            "model": model,
            "optim": {
                "state": {0: {"exp_avg": self.tensor(1), "step": torch.tensor(0.0)}},
                "param_groups": [{"lr": 0.1, "params": [0]}],
            },
            "ema": ema,
            "buffers": [self.tensor(1), self.tensor(2)],
            "step": 0,
        }

    # -- making values --------------------------------------------------------------------

    def tensor(self, dims: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        dims = self.rng.choice((0, 1, 2)) if dims is None else dims
        shape = tuple(self.rng.randint(1, MAX_SIDE) for _ in range(dims))
        return random_tensor(shape, dtype or self.rng.choice(DTYPES), self.gen)

    def noise_like(self, t: torch.Tensor) -> torch.Tensor:
        return random_tensor(tuple(t.shape), t.dtype, self.gen)

    def slots(self) -> list[Slot]:
        """Every tensor's place in dicts and lists (a loop, not a recursive closure, whose
        cycle would keep the tensors alive until the collector runs)."""
        out: list[Slot] = []
        stack: list[Any] = [self.sd]
        while stack:
            x = stack.pop()
            items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
            for k, v in items:
                if isinstance(v, torch.Tensor):
                    if k != "embedding":  # changed by change_embedding only
                        out.append((x, k))
                else:
                    stack.append(v)
        return out

    def pick(self) -> tuple[Slot, torch.Tensor]:
        slot = self.rng.choice(self.slots())
        return slot, slot[0][slot[1]]

    # -- changes --------------------------------------------------------------------------

    def write(self, t: torch.Tensor, value: torch.Tensor) -> None:
        """Write in place (bumping the counter); an inference tensor where it may be."""
        with torch.inference_mode() if t.is_inference() else torch.no_grad():
            t.copy_(value)

    def change_in_place(self) -> None:
        _, t = self.pick()
        self.write(t, self.noise_like(t))

    def change_through_a_view(self) -> None:
        _, t = self.pick()
        if t.numel():
            view = t.as_strided((1,), (1,), t.storage_offset())  # shares t's counter
            self.write(view, self.noise_like(view))

    def change_metadata(self) -> None:
        (box, key), t = self.pick()
        how = self.rng.choice(("t", "flat", "tail", "dtype", "param", "detach"))
        if how == "t" and t.dim() == 2:
            box[key] = t.t()
        elif how == "flat" and t.is_contiguous():
            box[key] = t.view(-1)
        elif how == "tail" and t.dim() and t.shape[0] > 1:
            box[key] = t[1:]
        elif how == "dtype":
            box[key] = t.to(self.rng.choice(DTYPES))
        elif how == "param" and not t.is_inference():
            grad = t.is_floating_point() and self.rng.random() < 0.5
            box[key] = torch.nn.Parameter(t.detach(), requires_grad=grad)
        elif how == "detach":
            box[key] = t.detach()  # the same counter: nothing to re-copy

    def change_aliasing(self) -> None:
        (box, key), t = self.pick()
        _, other = self.pick()
        how = self.rng.choice(("same", "view", "unshare"))
        if how == "same":
            box[key] = other
        elif how == "view" and other.dim() and other.shape[0] > 1:
            box[key] = other[: other.shape[0] // 2]
        elif how == "unshare":
            box[key] = t.clone()

    def free_and_reallocate(self) -> None:
        """The storage of a tensor is freed (or its memory re-allocated) and new tensors
        may take its memory: nothing may be taken for unchanged by its address."""
        (box, key), t = self.pick()
        how = self.rng.choice(("set_", "data", "set_new", "resize_storage", "resize_tensor"))
        if (t.is_inference() or t.requires_grad) and how in ("set_", "data", "set_new", "resize_tensor"):
            how = "resize_storage"  # the others are refused on these
        if how == "set_":
            box[key] = self.freed_and_replaced(t)
        elif how == "data":
            with torch.no_grad():
                t.data = self.noise_like(t)
        elif how == "set_new":
            fresh = self.noise_like(t).contiguous()
            with torch.no_grad():
                t.set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
        elif how == "resize_storage":
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            storage.resize_(0)
            self.tensor(1)  # allocations that may take the freed memory
            storage.resize_(nbytes)
            # The memory is new and its bytes undefined: write every one, through a tensor
            # of the state_dict (a write that bumps no counter is not seen, as documented).
            with torch.inference_mode() if t.is_inference() else torch.no_grad():
                raw = torch.empty(0, dtype=torch.uint8).set_(storage)
                raw.copy_(random_tensor((nbytes,), torch.uint8, self.gen))
                t.add_(0) if t.dtype is not torch.bool else t.logical_or_(t)
        elif how == "resize_tensor":
            shape = tuple(t.shape)
            with torch.no_grad():
                t.resize_(0)
                t.resize_(shape)  # contiguous strides again; bumps the counter

    def freed_and_replaced(self, t: torch.Tensor) -> torch.Tensor:
        """Free ``t``'s storage (``set_()``) and make a tensor of its size at once (it gets
        the freed memory, most often) whose counter has the value ``t``'s had: counters of
        tensors updated in step (an optimizer's) hold equal values all the time."""
        shape, dtype, version = tuple(t.shape), t.dtype, t._version
        value = self.noise_like(t)
        with torch.no_grad():
            t.set_()  # type: ignore[call-overload]
        fresh = torch.empty(shape, dtype=dtype)
        torch._C._autograd._unsafe_set_version_counter((fresh,), (max(0, version - 1),))
        fresh.copy_(value)  # the counter as it was
        return fresh

    def change_embedding(self) -> None:
        if self.rng.random() < 0.5:
            self.sd["embedding"] = self.freed_and_replaced(self.sd["embedding"])
        else:
            self.write(self.sd["embedding"], self.noise_like(self.sd["embedding"]))

    def change_structure(self) -> None:
        how = self.rng.choice(("add", "remove", "append", "lr_type", "lr_back"))
        sd = self.sd
        if how == "add" and len(self.slots()) < MAX_TENSORS:
            self.counter += 1
            sd["model"][f"extra{self.counter}"] = self.tensor()
        elif how == "remove":
            extras = [k for k in sd["model"] if k.startswith("extra")]
            if extras:
                del sd["model"][self.rng.choice(extras)]
        elif how == "append" and len(self.slots()) < MAX_TENSORS:
            sd["buffers"].append(self.tensor())
        elif how == "lr_type":
            sd["optim"]["param_groups"][0]["lr"] = torch.float16  # a scalar turned into a dtype
        elif how == "lr_back":
            sd["optim"]["param_groups"][0]["lr"] = self.rng.random()

    def change_scalars(self) -> None:
        self.sd["step"] += 1
        group = self.sd["optim"]["param_groups"][0]
        if isinstance(group["lr"], float):
            group["lr"] *= 0.9

    def change_inference(self) -> None:
        (box, key), t = self.pick()
        if self.rng.random() < 0.5:
            with torch.inference_mode():
                box[key] = self.noise_like(t).clone()
        else:
            self.write(self.sd["ema"], self.noise_like(self.sd["ema"]))

    def step(self) -> None:
        """Between zero and three random changes, most often one."""
        changes: list[Callable[[], None]] = [
            self.change_in_place,
            self.change_in_place,
            self.change_through_a_view,
            self.change_metadata,
            self.change_aliasing,
            self.free_and_reallocate,
            self.free_and_reallocate,
            self.change_structure,
            self.change_scalars,
            self.change_inference,
            self.change_embedding,
        ]
        for _ in range(self.rng.choice((0, 1, 1, 1, 2, 3))):
            self.rng.choice(changes)()
