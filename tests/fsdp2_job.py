"""A real FSDP2 job for the tests: a small transformer with many parameters, sharded with
``fully_shard`` over every rank of the default group, trained by AdamW on a seeded stream.

Its state (``get_state_dict``) is what every FSDP2 user saves: about 300 DTensors a rank
(parameters and AdamW moments sharded on dim 0) and plain step tensors.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

DIM, HEADS, LAYERS, VOCAB, SEQ = 32, 4, 6, 64, 8


class Block(nn.Module):
    """A pre-norm transformer block with separate q/k/v projections: many small parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        batch, seq, _ = h.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, HEADS, DIM // HEADS).transpose(1, 2)

        att = torch.softmax(
            heads(self.q(h)) @ heads(self.k(h)).transpose(-1, -2) / math.sqrt(DIM // HEADS), -1
        )
        x = x + self.o((att @ heads(self.v(h))).transpose(1, 2).reshape(batch, seq, DIM))
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def fsdp2_job() -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model, sharded over the default group, and its optimizer: the same on every run."""
    torch.manual_seed(0)  # the same full model on every rank, then sharded
    model = Model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, step: int, rank: int) -> float:
    """One step on this rank's batch of ``step``; the loss."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, VOCAB, (4, SEQ), generator=gen)
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1, 1).flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return float(loss.detach())
