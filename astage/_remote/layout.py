"""The layout of a run's steps on the store, and the commit object that completes a rank's upload.

::

    <prefix>/
        step_0000000042/
            rank00000.astage          rank 0's checkpoint file, byte for byte as on its disk
            rank00000.commit.json     rank 0's commit object: written last, after the data

A rank's upload of a step is committed on the store once its commit object exists; the
step is *complete* once every rank's is there (``world_size`` ranks, named by each commit
object, all agreeing).  The commit object is a small JSON (no pickle) carrying the data
object's size and crc32c, its storage-table checksum (as the local marker) and the
metrics passed to ``save()``, plus a crc32c of its own fields.

A listing is untrusted input: only keys of exactly this shape under the prefix are
looked at (a step directory name, then a rank's data or commit name); anything else
(``..``, absolute paths, other names, names of absurd length) is ignored, never followed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Final, Literal

from .._files.directory import rank_file_names, step_dir_name, step_of_dir
from .._files.markers import expect_int, json_document, marker_crc32c
from .._util.errors import IntegrityError
from .._util.limits import INT64, RANK_LIMIT

COMMIT_FORMAT: Final = "astage-remote-commit"
COMMIT_VERSION: Final = 1
COMMIT_CAP: Final = 1 << 16
"""The most bytes of a commit object ever read."""

RUN_KEY: Final = "astage-run.json"
"""The object that claims a prefix for one run (``Remote(run=...)``)."""

_KEY_CAP: Final = 64
_NAME_RE: Final = re.compile(r"\Arank([0-9]{5,10})\.(astage|commit\.json)\Z")
_ID_RE: Final = re.compile(r"\A[0-9a-f]{32}\Z")
_METRIC_KEY_RE: Final = re.compile(r"\A[A-Za-z0-9_.:/-]{1,64}\Z")

ObjectKind = Literal["data", "commit"]


def data_key(step: int, rank: int) -> str:
    """The key of ``rank``'s checkpoint file of ``step`` (relative to the prefix)."""
    return f"{step_dir_name(step)}/{rank_file_names(rank)[0]}"


def commit_key(step: int, rank: int) -> str:
    """The key of ``rank``'s commit object of ``step`` (relative to the prefix)."""
    return f"{step_dir_name(step)}/rank{rank:05d}.commit.json"


def parse_key(key: object) -> tuple[int, int, ObjectKind] | None:
    """``(step, rank, kind)`` of a key astage writes, or ``None`` for anything else."""
    if not isinstance(key, str) or len(key) > _KEY_CAP:
        return None
    parts = key.split("/")
    if len(parts) != 2:
        return None
    step = step_of_dir(parts[0])
    match = _NAME_RE.match(parts[1])
    if step is None or match is None:
        return None
    rank = int(match.group(1))
    if rank >= RANK_LIMIT:
        return None
    kind: ObjectKind = "data" if match.group(2) == "astage" else "commit"
    if key != (data_key(step, rank) if kind == "data" else commit_key(step, rank)):
        return None  # not the canonical spelling (leading zeros)
    return step, rank, kind


def check_metrics(metrics: object) -> dict[str, float]:
    """``metrics`` as passed to ``save()``: a mapping of short names to finite numbers.

    :raises IntegrityError: (callers turn it into a ConfigurationError) not of that shape.
    """
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise IntegrityError(f"metrics must be a dict of str to float, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or _METRIC_KEY_RE.match(key) is None:
            raise IntegrityError(f"metrics key {key!r:.80}: expected 1-64 characters of [A-Za-z0-9_.:/-]")
        if type(value) not in (int, float) or not math.isfinite(value):
            raise IntegrityError(f"metrics[{key!r}]: expected a finite number, got {value!r:.40}")
        out[key] = float(value)
    if len(out) > 64:
        raise IntegrityError(f"metrics: at most 64 entries, got {len(out)}")
    return out


@dataclasses.dataclass(frozen=True)
class CommitObject:
    """One rank's commit of one step on the store."""

    step: int
    rank: int
    world_size: int
    checkpoint_id: str
    created: float
    nbytes: int
    crc32c: int
    storages_crc32c: int
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> bytes:
        body = {
            "format": COMMIT_FORMAT,
            "version": COMMIT_VERSION,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "checkpoint_id": self.checkpoint_id,
            "created": self.created,
            "object": {
                "name": rank_file_names(self.rank)[0],
                "nbytes": self.nbytes,
                "crc32c": self.crc32c,
                "storages_crc32c": self.storages_crc32c,
            },
            "metrics": self.metrics,
        }
        return json.dumps({**body, "crc32c": marker_crc32c(body)}, allow_nan=False).encode("ascii")


def _int(doc: dict[str, Any], key: str, lo: int, hi: int) -> int:
    return expect_int(doc, key, lo, hi, "commit object")


_KEYS: Final = frozenset(
    {
        "format",
        "version",
        "step",
        "rank",
        "world_size",
        "checkpoint_id",
        "created",
        "object",
        "metrics",
        "crc32c",
    }
)


def parse_commit(data: bytes, *, step: int, rank: int) -> CommitObject:
    """Validate a commit object read from the store (untrusted, like any file).

    :raises IntegrityError: malformed, tampered (its checksum), or not ``rank``'s ``step``.
    """
    if len(data) > COMMIT_CAP:
        raise IntegrityError(f"commit object is over the {COMMIT_CAP}-byte cap")
    doc = json_document(data, "commit object", COMMIT_FORMAT, COMMIT_VERSION, _KEYS)
    body = {key: value for key, value in doc.items() if key != "crc32c"}
    try:
        expected = marker_crc32c(body)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"commit object: {exc}") from exc
    if type(doc["crc32c"]) is not int or doc["crc32c"] != expected:
        raise IntegrityError("commit object checksum mismatch")
    if _int(doc, "step", 0, INT64) != step or _int(doc, "rank", 0, RANK_LIMIT) != rank:
        raise IntegrityError(f"commit object is for step {doc['step']} rank {doc['rank']}, not {step}/{rank}")
    world_size = _int(doc, "world_size", 1, RANK_LIMIT + 1)
    if rank >= world_size:
        raise IntegrityError(f"commit object: rank {rank} is not below its world_size {world_size}")
    checkpoint_id, created, obj = doc["checkpoint_id"], doc["created"], doc["object"]
    if type(checkpoint_id) is not str or _ID_RE.match(checkpoint_id) is None:
        raise IntegrityError(f"commit object: bad checkpoint_id {checkpoint_id!r:.80}")
    if type(created) is not float or not math.isfinite(created):
        raise IntegrityError(f"commit object: bad created {created!r:.40}")
    if type(obj) is not dict or set(obj) != {"name", "nbytes", "crc32c", "storages_crc32c"}:
        raise IntegrityError(f"commit object: bad object entry {obj!r:.120}")
    if obj["name"] != rank_file_names(rank)[0]:
        raise IntegrityError(f"commit object names {obj['name']!r:.80}, not rank {rank}'s file")
    try:
        metrics = check_metrics(doc["metrics"])
    except IntegrityError as exc:
        raise IntegrityError(f"commit object: {exc}") from exc
    return CommitObject(
        step=step,
        rank=rank,
        world_size=world_size,
        checkpoint_id=checkpoint_id,
        created=created,
        nbytes=_int(obj, "nbytes", 0, INT64),
        crc32c=_int(obj, "crc32c", 0, 1 << 32),
        storages_crc32c=_int(obj, "storages_crc32c", 0, 1 << 32),
        metrics=metrics,
    )


@dataclasses.dataclass
class StepObjects:
    """What a listing shows of one step: each rank's data and commit object sizes."""

    step: int
    data: dict[int, int] = dataclasses.field(default_factory=dict)
    commits: dict[int, int] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.data.values())


def group_listing(entries: list[tuple[str, int]]) -> dict[int, StepObjects]:
    """The steps in a listing of ``(key, size)``; keys astage does not write are ignored."""
    steps: dict[int, StepObjects] = {}
    for key, size in entries:
        parsed = parse_key(key)
        if parsed is None or type(size) is not int or size < 0:
            continue
        step, rank, kind = parsed
        objects = steps.setdefault(step, StepObjects(step))
        (objects.data if kind == "data" else objects.commits)[rank] = size
    return steps
