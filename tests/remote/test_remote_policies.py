"""Retention policies per tier: pure choices (property-checked), the local tier's keep=, and
retention on the store (commit objects first, never the newest complete step)."""

from __future__ import annotations

from pathlib import Path

import obstore
import pytest
from hypothesis import given
from hypothesis import strategies as st

import astage
from astage._files.policies import StepInfo, retained
from astage._remote.layout import commit_key, data_key
from tests.remote.test_remote_tier import state


def infos(
    steps: list[int], created: list[float] | None = None, metric: list[float] | None = None
) -> list[StepInfo]:
    return [
        StepInfo(s, created[i] if created else float(s), {"loss": metric[i]} if metric else {})
        for i, s in enumerate(steps)
    ]


def test_each_policy_keeps_what_it_says() -> None:
    steps = infos([0, 5, 10, 15, 20, 25], created=[0, 1, 2, 30, 31, 62], metric=[5, 1, 3, 0.5, 9, 2])
    assert retained(astage.latest(2), steps) == {20, 25}
    assert retained(astage.every_steps(10), steps) == {0, 10, 20, 25}  # and the newest
    assert retained(astage.every_seconds(30), steps) == {0, 15, 25}
    assert retained(astage.best(2, "loss"), steps) == {15, 5, 25}
    assert retained(astage.best(1, "loss", mode="max"), steps) == {20, 25}
    assert retained(astage.keep_if(lambda s: s.step < 6), steps) == {0, 5, 25}
    combined = astage.every_steps(10) | astage.latest(2) | astage.best(1, "loss")
    assert retained(combined, steps) == {0, 10, 15, 20, 25}
    assert retained(None, steps) == {0, 5, 10, 15, 20, 25}
    assert retained(astage.latest(1), steps, pinned=[5, 99]) == {5, 25}
    assert repr(combined) == "every_steps(10) | latest(2) | best(1, 'loss', mode='min')"


@pytest.mark.parametrize(
    "make",
    [
        lambda: astage.latest(0),
        lambda: astage.every_steps(-1),
        lambda: astage.every_seconds(float("nan")),
        lambda: astage.best(1, ""),
        lambda: astage.best(1, "loss", mode="median"),  # type: ignore[arg-type]
        lambda: astage.keep_if(3),  # type: ignore[arg-type]
    ],
)
def test_bad_policies_are_refused(make: object) -> None:
    with pytest.raises(astage.ConfigurationError):
        make()  # type: ignore[operator]


policies = st.sampled_from(
    [
        astage.latest(1),
        astage.latest(3),
        astage.every_steps(4),
        astage.every_seconds(5.0),
        astage.best(2, "loss"),
        astage.best(1, "loss", "max"),
        astage.every_steps(3) | astage.latest(2),
        astage.keep_if(lambda s: s.step % 7 == 0),
    ]
)


@given(
    policy=policies,
    steps=st.lists(st.integers(0, 10**6), min_size=0, max_size=30, unique=True),
    pinned=st.lists(st.integers(0, 10**6), max_size=5),
    seed=st.integers(0, 1000),
)
def test_retention_never_drops_the_newest_or_a_pinned_step(
    policy: astage.Policy, steps: list[int], pinned: list[int], seed: int
) -> None:
    steps = sorted(steps)
    data = infos(
        steps,
        created=[float(s % 97 + i) for i, s in enumerate(steps)],
        metric=[(s * seed) % 13 for s in steps],
    )
    kept = retained(policy, data, pinned)
    assert kept <= set(steps)
    if steps:
        assert max(steps) in kept
    assert set(pinned) & set(steps) <= kept
    # Pure: the same input gives the same answer, and keeping more never drops a kept step.
    assert retained(policy, data, pinned) == kept
    assert kept <= retained(policy | astage.latest(2), data, pinned)


@pytest.mark.anyio
async def test_local_tier_policies_with_metrics(tmp_path: Path) -> None:
    losses = {0: 3.0, 1: 0.5, 2: 2.0, 3: 0.1, 4: 4.0, 5: 5.0}
    keep = astage.best(2, "loss") | astage.latest(1)
    async with astage.Checkpointer(tmp_path / "a", keep=keep, max_in_flight=1) as ckpt:
        for step, loss in losses.items():
            await (await ckpt.save(step, state(step), metrics={"loss": loss})).wait()
        await ckpt.wait()
    async with astage.Checkpointer(tmp_path / "a", keep=None) as ckpt:
        assert ckpt.steps() == [1, 3, 5]
    with pytest.raises(astage.ConfigurationError, match="metrics"):
        async with astage.Checkpointer(tmp_path / "b") as ckpt:
            await ckpt.save(0, state(0), metrics={"loss": float("nan")})


@pytest.mark.anyio
async def test_store_retention_deletes_commit_objects_first_and_keeps_the_newest(tmp_path: Path) -> None:
    remote = astage.Remote("memory:///", keep=astage.every_steps(4) | astage.latest(1))
    async with astage.Checkpointer(tmp_path / "a", remote=remote, keep=1) as ckpt:
        for step in range(7):
            await (await ckpt.save(step, state(step))).uploaded()
    store = remote.client().store
    keys = {m["path"] for m in obstore.list(store).collect()}
    assert keys == {data_key(s, 0) for s in (0, 4, 6)} | {commit_key(s, 0) for s in (0, 4, 6)}
    async with astage.Checkpointer(tmp_path / "fresh", remote=remote) as ckpt:
        for step in (0, 4, 6):
            assert (await ckpt.restore(step=step))["step"] == step
        with pytest.raises(astage.ResourceError):
            await ckpt.restore(step=5)
