"""Staging that can be trusted blindly: bytes, snapshots, refusals, modes, lifecycles.

* A storage is copied as bytes, whatever dtype views it.
* A container another task changes while ``stage()`` yields is staged as one of its states,
  never torn, never a raw ``RuntimeError``.
* What cannot be copied faithfully is refused while planning, with its key path.
* ``stage()`` works inside ``torch.inference_mode()`` and leaks no mode to other tasks.
* Closing wakes waiters, every argument is validated, one event loop at a time, and
  ``release()`` refuses what the stager never staged.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import io
import mmap
import socket
import sys
import tempfile
import threading
import types
import typing
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from astage import (
    AstageError,
    BlockingStager,
    ClosedError,
    ConfigurationError,
    DefaultStager,
    EventLoopError,
    StagingOptions,
    UnsupportedInputError,
    wait_event,
)
from astage._staging.plan import MAX_DEPTH
from astage._staging.pool import BufferKind, BufferPool
from tests.helpers import until
from tests.statedicts import assert_same_tree, storage_key

# -- a storage is copied as bytes ----------------------------------------------------------------


def _viewable_dtypes() -> list[torch.dtype]:
    """Every dtype that can view a byte storage and be staged (quantized tensors are refused)."""
    out = []
    for name in dir(torch):
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype) or dtype in out or "qint" in name or "quint" in name:
            continue
        try:
            torch.zeros(16, dtype=torch.uint8).view(dtype)
        except (RuntimeError, TypeError):
            continue
        out.append(dtype)
    return sorted(out, key=str)


VIEW_DTYPES = _viewable_dtypes()


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """All bytes of ``t``'s storage, as a uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def stagers() -> list[Callable[[], DefaultStager]]:
    return [
        DefaultStager,
        lambda: DefaultStager(StagingOptions(use_async_staging=False)),
        BlockingStager,
    ]


def test_the_viewable_dtypes_include_every_kind_of_element() -> None:
    wanted = {torch.bool, torch.uint8, torch.int16, torch.float32, torch.bfloat16, torch.complex128}
    wanted |= {d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None}
    assert wanted <= set(VIEW_DTYPES)


@pytest.mark.anyio
@pytest.mark.parametrize("make", stagers(), ids=["threads", "inline", "blocking"])
async def test_a_bool_view_first_does_not_squash_the_bytes(make: Callable[[], DefaultStager]) -> None:
    u = torch.tensor([0, 1, 2, 255, 7, 128, 1, 0], dtype=torch.uint8)
    async with make() as stager:
        staged = await stager.stage({"mask": u.view(torch.bool), "raw": u})
    assert staged["raw"].tolist() == [0, 1, 2, 255, 7, 128, 1, 0]
    assert storage_key(staged["mask"]) == storage_key(staged["raw"])


class ViewCase(NamedTuple):
    data: bytes
    first: torch.dtype
    second: torch.dtype
    second_offset: int
    reverse: bool
    inline: bool


@st.composite
def view_cases(draw: st.DrawFn) -> ViewCase:
    first, second = draw(st.sampled_from(VIEW_DTYPES)), draw(st.sampled_from(VIEW_DTYPES))
    # A multiple of 16 bytes: every element size (complex128 is 16) divides it.
    data = draw(st.binary(min_size=16, max_size=96).map(lambda b: b[: len(b) // 16 * 16]))
    second_size = torch.empty(0, dtype=second).element_size()
    offset = draw(st.integers(0, len(data) // second_size - 1))
    return ViewCase(data, first, second, offset, draw(st.booleans()), draw(st.booleans()))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=view_cases())
def test_every_pair_of_dtypes_viewing_one_storage_is_staged_as_its_bytes(
    backend: str, case: ViewCase
) -> None:
    """Random bytes (NaN payloads, bools above 1, fp8 specials) viewed by any two dtypes,
    one view over the whole storage and one offset into it, in either order."""
    raw = torch.frombuffer(bytearray(case.data), dtype=torch.uint8)
    whole = raw.view(case.first)
    part = raw.view(case.second)[case.second_offset :]
    sd = {"part": part, "whole": whole} if case.reverse else {"whole": whole, "part": part}

    async def stage() -> Any:
        async with DefaultStager(StagingOptions(use_async_staging=not case.inline)) as stager:
            return await stager.stage(sd)

    staged = anyio.run(stage, backend=backend)
    assert storage_key(staged["whole"]) == storage_key(staged["part"]), "the aliasing is kept"
    assert bytes(raw_bytes(staged["whole"]).tolist()) == case.data
    for key in ("whole", "part"):
        got, src = staged[key], sd[key]
        assert (got.dtype, got.shape, got.stride()) == (src.dtype, src.shape, src.stride())
        assert got.storage_offset() == src.storage_offset()


@pytest.mark.anyio
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("inline", [False, True], ids=["threads", "inline"])
async def test_every_ordered_pair_of_dtypes_at_once(inline: bool) -> None:
    """Every ordered pair over one storage of all 256 byte values, in one stage."""
    sd = {}
    for a in VIEW_DTYPES:
        for b in VIEW_DTYPES:
            raw = torch.arange(256, dtype=torch.uint8).roll(len(sd))
            sd[f"{a}|{b}"] = [raw.view(a), raw.view(b)[1:]]
    async with DefaultStager(StagingOptions(use_async_staging=not inline)) as stager:
        staged = await stager.stage(sd)
    for key, (first, second) in staged.items():
        assert storage_key(first) == storage_key(second), key
        assert torch.equal(raw_bytes(first), raw_bytes(sd[key][0])), key


# -- containers changed while stage() yields -----------------------------------------------------


class Spy(list[Any]):
    """A list that notes when the walk reads it (the walk has then begun)."""

    seen = False

    def __iter__(self) -> Iterator[Any]:
        Spy.seen = True
        return super().__iter__()


def many_tensors() -> list[Any]:
    """A list whose walk spans many time slices, starting with a :class:`Spy`."""
    return [Spy(), *(torch.full((2,), float(i)) for i in range(3000))]


class Holder:
    def __init__(self, items: list[Any]) -> None:
        self.items = items


def _remove_first(sd: dict[str, Any]) -> None:
    del sd["big"][0]


def _add_key(sd: dict[str, Any]) -> None:
    sd["late"] = torch.ones(1)


def _add_attribute(sd: dict[str, Any]) -> None:
    sd["obj"].late = torch.ones(1)


def _add_ordered_key(sd: dict[str, Any]) -> None:
    sd["od"]["late"] = torch.ones(1)


def _move_item_between_lists(sd: dict[str, Any]) -> None:
    sd["other"].append(sd["big"].pop(1))


def _grow_set(sd: dict[str, Any]) -> None:
    sd["set"].add("late")


MUTATIONS: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]] = {
    "list item removed": (lambda: {"big": many_tensors(), "after": 1}, _remove_first),
    "dict gains a key": (lambda: {"big": many_tensors(), "after": 1}, _add_key),
    "object gains an attribute": (lambda: {"obj": Holder(many_tensors())}, _add_attribute),
    "OrderedDict gains a key": (
        lambda: {"od": collections.OrderedDict(big=many_tensors(), b=1)},
        _add_ordered_key,
    ),
    "item moved between lists": (lambda: {"big": many_tensors(), "other": []}, _move_item_between_lists),
    "set grows": (lambda: {"big": many_tensors(), "set": {"a"}}, _grow_set),
}


def flatten(tree: Any) -> Any:
    """A comparable picture of a tree: tensors by value, containers by content."""
    if isinstance(tree, torch.Tensor):
        return ("tensor", tuple(tree.tolist()))
    if isinstance(tree, dict):
        return ("dict", tuple((k, flatten(v)) for k, v in tree.items()))
    if isinstance(tree, (list, tuple)):
        return ("seq", tuple(flatten(v) for v in tree))
    if isinstance(tree, Holder):
        return ("holder", tuple((k, flatten(v)) for k, v in vars(tree).items()))
    if isinstance(tree, set):
        return ("set", tuple(sorted(tree)))
    return tree


@pytest.mark.anyio
@pytest.mark.parametrize("name", list(MUTATIONS))
async def test_a_container_changed_during_the_walk_is_staged_as_one_of_its_states(name: str) -> None:
    build, mutate = MUTATIONS[name]
    sd = build()
    before = flatten(sd)
    Spy.seen = False
    mutated = False

    async def mutator() -> None:
        nonlocal mutated
        while not Spy.seen:
            await anyio.lowlevel.checkpoint()
        mutate(sd)  # at the walk's next yield: it is inside the big list
        mutated = True

    async with DefaultStager() as stager, anyio.create_task_group() as tg:
        tg.start_soon(mutator)
        staged = await stager.stage(sd)
    assert mutated
    after = flatten(sd)
    # Each container is staged as it was when its walk began; across containers, no more
    # is promised (a moved item may show in both lists or in neither).
    got = flatten(staged)
    if name == "item moved between lists":
        assert got[1][0] == before[1][0]
        assert got[1][1][1] in (before[1][1][1], after[1][1][1])
    else:
        assert got in (before, after), "staged torn: matches neither state"


# -- what cannot be copied faithfully is refused while planning -----------------------------------


class NeedsArgument:
    def __new__(cls, value: int) -> NeedsArgument:
        return super().__new__(cls)

    def __init__(self, value: int) -> None:
        self.value = value


def _generator() -> Iterator[int]:
    yield 1


async def _coroutine() -> None:
    pass


def _closed_bytes_io() -> io.BytesIO:
    out = io.BytesIO(b"data")
    out.close()
    return out


@pytest.fixture
def unsupported(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """One value of each kind that cannot be staged faithfully."""
    text = (tmp_path / "f.txt").open("w")
    binary = (tmp_path / "g.bin").open("wb")
    named = tempfile.NamedTemporaryFile(dir=tmp_path)  # noqa: SIM115 - closed below
    mapped = mmap.mmap(-1, 4096)
    sock = socket.socket()
    coroutine = _coroutine()
    target = Holder([])
    cases: dict[str, Any] = {
        "text file": text,
        "temporary file wrapper": named,
        "mmap": mapped,
        "binary file": binary,
        "StringIO": io.StringIO("data"),  # (an exact io.BytesIO is staged: tests/format/test_bytes_io.py)
        "BytesIO subclass": type("Sub", (io.BytesIO,), {})(b"data"),
        "closed BytesIO": _closed_bytes_io(),
        "socket": sock,
        "thread": threading.Thread(target=print),
        "lock": threading.Lock(),
        "rlock": threading.RLock(),
        "condition": threading.Condition(),
        "event": threading.Event(),
        "generator": _generator(),
        "coroutine": coroutine,
        "frame": sys._getframe(),
        "weakref": weakref.ref(NeedsArgument),
        "weakproxy": weakref.proxy(target),
        "partial": functools.partial(print, 1),
        "needs an argument": NeedsArgument(3),
        "exception": ValueError("x"),
    }
    yield cases
    text.close()
    binary.close()
    named.close()
    mapped.close()
    sock.close()
    coroutine.close()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "name",
    [
        "text file",
        "temporary file wrapper",
        "mmap",
        "binary file",
        "StringIO",
        "BytesIO subclass",
        "closed BytesIO",
        "socket",
        "thread",
        "lock",
        "rlock",
        "condition",
        "event",
        "generator",
        "coroutine",
        "frame",
        "weakref",
        "weakproxy",
        "partial",
        "needs an argument",
        "exception",
    ],
)
async def test_what_cannot_be_copied_faithfully_is_refused_before_any_copy(
    name: str, unsupported: dict[str, Any]
) -> None:
    sd = {"w": torch.randn(1000), "opt": {"state": [torch.ones(2), unsupported[name]]}}
    async with DefaultStager() as stager:
        with pytest.raises(UnsupportedInputError) as err:
            await stager.stage(sd)
        assert err.value.key_path[:3] == ("opt", "state", 1)
        assert stager.pool_stats().allocated_bytes_ever == 0, "refused while planning, before copying"
        assert (await stager.stage({"ok": torch.ones(1)}))["ok"].item() == 1.0


def nested(kind: str, depth: int) -> Any:
    node: Any = torch.ones(1)
    for _ in range(depth):
        if kind == "dict":
            node = {"a": node}
        elif kind == "list":
            node = [node]
        elif kind == "tuple":
            node = (node, 1)
        else:
            node = types.SimpleNamespace(a=node)
    return node


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["dict", "list", "tuple", "object"])
async def test_nesting_deeper_than_the_limit_is_refused_not_a_recursion_error(kind: str) -> None:
    async with DefaultStager() as stager:
        ok = await stager.stage({"x": nested(kind, MAX_DEPTH - 2)})
        assert ok is not None
        for depth in (MAX_DEPTH + 1, 400, 5000):
            with pytest.raises(UnsupportedInputError, match=f"deeper than {MAX_DEPTH}"):
                await stager.stage({"x": nested(kind, depth)})


def test_objects_rebuilt_from_their_attributes_still_stage() -> None:
    """The refusals do not catch what rebuilds faithfully: plain classes, slots, Paths."""

    class Slotted:
        __slots__ = ("a", "b")

    s = Slotted()
    s.a = torch.ones(2)
    sd = {
        "ns": types.SimpleNamespace(t=torch.zeros(3)),
        "slotted": s,
        "path": Path("/tmp/x"),
        "module": torch.nn.Linear(2, 2),
        "counter": collections.Counter("aab"),
        "deque": collections.deque([1, 2]),
        "global": typing.Any,  # pickled by name: kept by reference
    }

    async def stage() -> Any:
        async with DefaultStager() as stager:
            return await stager.stage(sd)

    staged = anyio.run(stage)
    assert torch.equal(staged["ns"].t, sd["ns"].t)
    assert torch.equal(staged["slotted"].a, s.a)
    assert not hasattr(staged["slotted"], "b")
    assert staged["path"] == sd["path"]
    assert_same_tree(staged["module"].state_dict(), sd["module"].state_dict())
    assert staged["counter"] == sd["counter"]
    assert staged["deque"] == sd["deque"]
    assert staged["global"] is typing.Any


# -- torch.inference_mode ------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("make", stagers(), ids=["threads", "inline", "blocking"])
async def test_stage_works_inside_inference_mode(make: Callable[[], DefaultStager]) -> None:
    plain = torch.randn(64, 8)
    with torch.inference_mode():
        inference = torch.arange(10.0)  # an inference tensor as a source, too
        sd = {"w": plain, "t": plain.t(), "inf": inference, "p": torch.nn.Parameter(torch.ones(3))}
        async with make() as stager:
            staged = await stager.stage(sd)
            again = await stager.stage(sd)
        doubled = staged["w"] * 2  # usable inside the mode
    assert torch.equal(doubled, plain * 2)
    for out in (staged, again):
        assert torch.equal(out["w"], plain)
        assert torch.equal(out["inf"], inference)
        assert storage_key(out["w"]) == storage_key(out["t"])
        assert not any(t.is_inference() for t in (out["w"], out["t"], out["inf"]))
    staged["w"].add_(1)  # and outside it: a plain tensor
    assert isinstance(staged["p"], torch.nn.Parameter)


@pytest.mark.anyio
async def test_staging_leaks_no_autograd_mode_to_other_tasks() -> None:
    sd = {f"k{i}": torch.randn(4) for i in range(4000)}
    seen: set[tuple[bool, bool]] = set()
    done = False

    async def observer() -> None:
        while not done:
            seen.add((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
            await anyio.lowlevel.checkpoint()

    async with DefaultStager() as stager, anyio.create_task_group() as tg:
        tg.start_soon(observer)
        for _ in range(3):
            await stager.stage(sd)
        done = True
    assert seen == {(True, False)}


# -- lifecycles ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_aclose_wakes_a_stage_waiting_for_room_with_closed_error() -> None:
    stager = DefaultStager(StagingOptions(max_staging_bytes=1 << 20))
    held = await stager.stage({"x": torch.zeros(200_000)})
    outcome: list[BaseException | None] = []
    closed = anyio.Event()

    async def waiter() -> None:
        try:
            await stager.stage({"y": torch.zeros(200_000)})
            outcome.append(None)
        except ClosedError as exc:
            outcome.append(exc)

    async def close() -> None:
        await stager.aclose()
        closed.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await until(lambda: stager.pool_stats().waiters == 1)
        tg.start_soon(close)
        with anyio.move_on_after(5):
            await closed.wait()
        finished = closed.is_set()
        del held  # on failure, make room so that nothing hangs
    assert finished, "aclose() hung while a stage waited for room"
    assert len(outcome) == 1
    assert isinstance(outcome[0], ClosedError)
    assert "closed" in str(outcome[0])
    assert stager.closed
    assert stager.pool_stats().total_bytes == 0


@pytest.mark.anyio
async def test_a_cancelled_aclose_leaves_the_stager_closed_and_nothing_running() -> None:
    stager = DefaultStager()
    outcomes: list[Any] = []
    started = anyio.Event()

    async def run() -> None:
        started.set()  # stage() counts itself in flight before its first await
        try:
            outcomes.append(await stager.stage({"x": torch.randn(1 << 20)}))
        except ClosedError as exc:  # closed before it had its buffers
            outcomes.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await started.wait()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await stager.aclose()
    assert stager.closed
    assert len(outcomes) == 1, "the in-flight stage ended on its own"
    assert stager.pool_stats().leased_bytes == 0
    await stager.aclose()  # idempotent after a cancelled close
    with pytest.raises(ClosedError):
        await stager.stage({"x": torch.ones(1)})


BAD_ARGUMENTS: dict[str, tuple[Callable[[], object], str]] = {
    "threads=0": (lambda: DefaultStager(threads=0), "threads"),
    "threads=-1": (lambda: DefaultStager(threads=-1), "threads"),
    "threads=1.5": (lambda: DefaultStager(threads=1.5), "threads"),  # type: ignore[arg-type]
    "threads=True": (lambda: DefaultStager(threads=True), "threads"),
    "threads='2'": (lambda: DefaultStager(threads="2"), "threads"),  # type: ignore[arg-type]
    "event_strategy=bogus": (lambda: DefaultStager(event_strategy="bogus"), "event_strategy"),  # type: ignore[arg-type]
    "event_strategy=None": (lambda: DefaultStager(event_strategy=None), "event_strategy"),  # type: ignore[arg-type]
    "options=dict": (lambda: DefaultStager({"use_async_staging": False}), "options"),  # type: ignore[arg-type]
    "cache='yes'": (lambda: BlockingStager("yes"), "cache_staged_state_dict"),  # type: ignore[arg-type]
    "type_check=1": (lambda: BlockingStager(type_check=1), "type_check"),  # type: ignore[arg-type]
    "kind='plain'": (lambda: BufferPool("plain"), "kind"),  # type: ignore[arg-type]
    "max_bytes=0": (lambda: BufferPool(max_bytes=0), "max_bytes"),
    "max_bytes=1.5": (lambda: BufferPool(max_bytes=1.5), "max_bytes"),  # type: ignore[arg-type]
    "max_bytes=True": (lambda: BufferPool(max_bytes=True), "max_bytes"),
    "retain=None": (lambda: BufferPool(retain=None), "retain"),  # type: ignore[arg-type]
    "allocate_inline='no'": (lambda: BufferPool(allocate_inline="no"), "allocate_inline"),  # type: ignore[arg-type]
    "use_shared_memory=1": (lambda: StagingOptions(use_shared_memory=1), "use_shared_memory"),  # type: ignore[arg-type]
    "use_async_staging=None": (lambda: StagingOptions(use_async_staging=None), "use_async_staging"),  # type: ignore[arg-type]
    "use_pinned_memory='x'": (lambda: StagingOptions(use_pinned_memory="x"), "use_pinned_memory"),  # type: ignore[arg-type]
    "max_staging_bytes=-1": (lambda: StagingOptions(max_staging_bytes=-1), "max_staging_bytes"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_every_constructor_argument_is_validated(case: str) -> None:
    build, argument = BAD_ARGUMENTS[case]
    with pytest.raises(ConfigurationError, match=argument) as err:
        build()
    assert "must be" in str(err.value), "the message says what is expected"


def test_good_arguments_are_accepted() -> None:
    DefaultStager(StagingOptions(), threads=1, event_strategy="thread")
    BlockingStager(cache_staged_state_dict=True, type_check=True)
    BufferPool(BufferKind.SHARED, max_bytes=1, retain=False, allocate_inline=True)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("kwargs", "argument"), [({"strategy": "bogus"}, "strategy"), ({"max_delay": 0}, "max_delay")]
)
async def test_wait_event_validates_its_arguments(kwargs: dict[str, Any], argument: str) -> None:
    class Done:
        def query(self) -> bool:
            return True

    with pytest.raises(ConfigurationError, match=argument):
        await wait_event(Done(), **kwargs)


def run_in_thread(fn: Callable[[], None], seconds: float = 30.0) -> None:
    """Run ``fn`` in a daemon thread and fail (instead of hanging) if it does not end."""
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "deadlocked"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_second_event_loop_gets_a_clear_error_not_a_deadlock(backend: str) -> None:
    stager = DefaultStager(StagingOptions(max_staging_bytes=1 << 20))
    waiting, other_done = threading.Event(), threading.Event()
    other: list[BaseException | None] = []

    async def first_loop() -> None:
        held = await stager.stage({"x": torch.zeros(200_000)})
        async with anyio.create_task_group() as tg:
            tg.start_soon(stager.stage, {"y": torch.zeros(200_000)})  # waits for room
            await until(lambda: stager.pool_stats().waiters == 1)
            waiting.set()
            await anyio.to_thread.run_sync(other_done.wait, 20)
            await stager.release(held)  # room: the waiting stage finishes
        await stager.aclose()

    def second_loop() -> None:
        waiting.wait(20)
        try:
            asyncio.run(stager.stage({"z": torch.ones(4)}))
            other.append(None)
        except BaseException as exc:
            other.append(exc)
        finally:
            other_done.set()

    second = threading.Thread(target=second_loop, daemon=True)
    second.start()
    run_in_thread(lambda: anyio.run(first_loop, backend=backend))
    second.join(20)
    assert len(other) == 1
    assert isinstance(other[0], EventLoopError), other
    assert "one event loop at a time" in str(other[0])


def test_two_threads_each_running_asyncio_never_deadlock() -> None:
    stager = DefaultStager()
    outcomes: list[str] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        async def main() -> None:
            for i in range(20):
                try:
                    staged = await stager.stage({"x": torch.full((1000,), float(seed * 100 + i))})
                    assert staged["x"][0].item() == seed * 100 + i
                    await stager.release(staged)
                    result = "ok"
                except EventLoopError:
                    result = "refused"
                with lock:
                    outcomes.append(result)

        asyncio.run(main())

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "deadlocked"
    assert len(outcomes) == 40
    assert "ok" in outcomes


def test_a_stager_moves_between_loops_when_idle() -> None:
    stager = DefaultStager(StagingOptions(max_staging_bytes=1 << 20))
    for backend in ("asyncio", "trio", "asyncio"):

        async def once() -> None:
            staged = await stager.stage({"x": torch.arange(10.0)})
            assert staged["x"].sum().item() == 45.0
            await stager.release(staged)

        run_in_thread(lambda: anyio.run(once, backend=backend))  # noqa: B023 - run at once


@pytest.mark.anyio
async def test_release_refuses_what_this_stager_never_staged() -> None:
    source = {"a": torch.ones(3), "b": [torch.zeros(2)]}
    async with DefaultStager() as stager, DefaultStager() as other:
        staged = await stager.stage(source)
        foreign = await other.stage(source)
        with pytest.raises(UnsupportedInputError, match="did not stage") as err:
            await stager.release(source)
        assert err.value.key_path == ("a",)
        with pytest.raises(UnsupportedInputError, match="did not stage"):
            await stager.release(foreign)
        mixed = {"mine": staged["a"], "theirs": foreign["b"]}
        with pytest.raises(UnsupportedInputError) as err:
            await stager.release(mixed)
        assert err.value.key_path == ("theirs", 0)
        assert torch.equal(staged["a"], torch.ones(3)), "nothing is released when one is foreign"
        await stager.release(staged)
        assert stager.pool_stats().handed_out_bytes == 0, "every buffer is back at once"
        await stager.release(staged)  # a second release of the same copy is a no-op
        # The released copy is kept whole for the next stage to refill, not emptied.
        assert torch.equal(staged["a"], torch.ones(3))
        assert await stager.stage(source) is staged
    await stager.release(foreign)  # closed: buffers were let go already, nothing to do
    assert issubclass(EventLoopError, AstageError)


class _NotedDefaultDict(collections.defaultdict):  # type: ignore[type-arg]
    """A Python subclass of a C container: it has a ``__dict__``, its base has none."""


class _IntList(list):  # type: ignore[type-arg]
    __slots__ = ()  # no __dict__ at all


def _c_subclass_containers() -> dict[str, Callable[[], Any]]:
    def noted() -> Any:
        d = _NotedDefaultDict(list, {"w": torch.arange(4.0)})
        d.note = "kept"
        return d

    return {
        "defaultdict": lambda: collections.defaultdict(list, {"w": torch.arange(4.0)}),
        "nested defaultdict": lambda: collections.defaultdict(dict, {"m": {"w": torch.arange(4.0)}}),
        "defaultdict subclass with attributes": noted,
        "list subclass without __dict__": lambda: _IntList([torch.arange(4.0)]),
    }


def _only_tensor(container: Any) -> torch.Tensor:
    item = next(iter(container.values())) if isinstance(container, dict) else container[0]
    return item["w"] if isinstance(item, dict) else item


@pytest.mark.anyio
@pytest.mark.parametrize("make", _c_subclass_containers().values(), ids=_c_subclass_containers())
async def test_containers_without_a_dict_of_their_own_are_staged_faithfully(make: Callable[[], Any]) -> None:
    # A defaultdict has no __dict__: staging one raised a bare TypeError from vars().
    source = {"c": make()}
    async with DefaultStager() as stager:
        for _ in range(2):  # the first stage, then the refill of the released copy
            staged = await stager.stage(source)
            copy, original = staged["c"], source["c"]
            assert type(copy) is type(original)
            assert getattr(copy, "default_factory", None) == getattr(original, "default_factory", None)
            assert getattr(copy, "__dict__", {}) == getattr(original, "__dict__", {})
            got, want = _only_tensor(copy), _only_tensor(original)
            assert torch.equal(got, want)
            assert got.untyped_storage().data_ptr() != want.untyped_storage().data_ptr()
            await stager.release(staged)
