"""The format's bulk paths: storage views sliced from one address range, and headers that
take the parser's column-at-a-time paths or not, read alike."""

from __future__ import annotations

import crc32c
import numpy as np
import torch

from astage import _format
from astage._format import _storage_views


def _storages() -> list[torch.UntypedStorage]:
    # Empty storages (whose pointers may be null) first, last and between; heap-sized and
    # mmap-sized allocations, which lie far apart; a numpy array's memory.
    tensors = [
        torch.empty(0),
        torch.arange(5, dtype=torch.int16),
        torch.full((1 << 20,), 3.0),
        torch.empty(0, dtype=torch.uint8),
        torch.from_numpy(np.arange(7, dtype=np.int64)),
        torch.tensor([1.5]),
        torch.empty(0),
    ]
    return [t.untyped_storage() for t in tensors]


def test_storage_views_are_exactly_each_storages_bytes() -> None:
    storages = _storages()
    views = list(_storage_views(storages))
    assert [len(v) for v in views] == [s.nbytes() for s in storages]
    for view, storage in zip(views, storages, strict=True):
        assert view.readonly
        expected = torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()
        assert bytes(view) == expected
        assert crc32c.crc32c(view) == crc32c.crc32c(expected)


def test_storage_views_of_only_empty_storages() -> None:
    storages = [torch.empty(0).untyped_storage() for _ in range(3)]
    assert [bytes(v) for v in _storage_views(storages)] == [b""] * 3
    assert list(_storage_views([])) == []


def test_an_encoded_file_of_scattered_and_empty_storages_round_trips() -> None:
    state = {f"t{i}": torch.empty(0, dtype=torch.uint8).set_(s) for i, s in enumerate(_storages())}
    encoded = _format.encode(state, owner_rank=0, step=1, checkpoint_id="views")
    body = torch.frombuffer(bytearray(b"".join(encoded.buffers())[len(encoded.prefix) :]), dtype=torch.uint8)
    got = _format.decode(_format.parse_prefix(encoded.prefix), body)
    assert got.keys() == state.keys()
    for key, tensor in state.items():
        assert torch.equal(got[key], tensor)
