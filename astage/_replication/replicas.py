"""The replica files a rank holds for its ring peer: finding them and reading one back."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

from .._files.durable import replica_path
from .._files.reading import CheckpointFile, inspect_checkpoint_file
from .._format.codec import byte_view, verify_body
from .._util.errors import IntegrityError

log = logging.getLogger("astage.replication")


def held_replica_paths(storage_dir: Path, *, owner_rank: int, holder_rank: int) -> dict[int, Path]:
    """Replica files of ``owner_rank`` kept by ``holder_rank`` in ``storage_dir``, by step (blocking).

    Step-named files by their name; the single file kept without ``keep`` by its header's
    step (skipped when its prefix is invalid).
    """
    prefix = replica_path(storage_dir, owner_rank=owner_rank, holder_rank=holder_rank).name[: -len(".astage")]
    pattern = re.compile(re.escape(prefix) + r"-step([0-9]{10,19})\.astage\Z")
    found: dict[int, Path] = {}
    try:
        with os.scandir(storage_dir) as listing:
            entries = [e for e in listing if e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return found
    for entry in entries:
        match = pattern.match(entry.name)
        if match is not None:
            found[int(match.group(1))] = Path(entry.path)
        elif entry.name == prefix + ".astage":
            try:
                found.setdefault(inspect_checkpoint_file(entry.path).step, Path(entry.path))
            except (OSError, IntegrityError) as exc:
                log.warning("ignoring the held replica %s: %s", entry.path, exc)
    return found


def read_replica_file(path: Path) -> tuple[bytes, torch.Tensor] | None:
    """A held replica's prefix and body, verified; ``None`` if missing or invalid.

    Opened like every replica astage reads (:class:`astage._files.reading.CheckpointFile`): a link
    or a FIFO planted under the replica's name is refused, never followed or waited on.
    """
    try:
        f = CheckpointFile(path)
    except FileNotFoundError:
        return None
    except (OSError, IntegrityError) as exc:
        log.warning("not sending the replica at %s back: %s", path, exc)
        return None
    try:
        header, _ = f.header()
        body = torch.empty(header.body_nbytes, dtype=torch.uint8)
        f.read_into(byte_view(body), header.prefix_nbytes)
        verify_body(header, body)
    except (OSError, IntegrityError) as exc:
        log.warning("not sending the replica at %s back: %s", path, exc)
        return None
    finally:
        f.close()
    return f.prefix, body
