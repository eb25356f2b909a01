"""The pure plan: structure, aliasing and the errors for what cannot be staged."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

from astage import UnsupportedInputError
from astage._staging.plan import TensorKind, plan_state_dict
from astage._staging.rebuild import rebuild
from tests.statedicts import assert_same_tree, rich_state_dict, storage_key


def copy_via_plan(sd: object) -> object:
    source = plan_state_dict(sd)
    storages = [torch.UntypedStorage(s.nbytes) for s in source.plan.storages]
    for dst, src in zip(storages, source.storages, strict=True):
        dst.copy_(src)
    return rebuild(source.plan, storages)


def test_rich_tree_round_trips_through_plan_and_rebuild() -> None:
    sd = rich_state_dict()
    assert_same_tree(copy_via_plan(sd), sd)


def test_shared_storages_are_planned_once() -> None:
    base = torch.randn(10)
    plan = plan_state_dict({"a": base, "b": base[2:5], "c": base.view(2, 5), "d": torch.randn(3)}).plan
    assert len(plan.tensors) == 4
    assert len(plan.storages) == 2
    assert plan.nbytes == 10 * 4 + 3 * 4
    assert [t.offset for t in plan.tensors] == [0, 2, 0, 0]


def test_the_same_tensor_twice_is_one_tensor_in_the_copy() -> None:
    p = torch.nn.Parameter(torch.randn(3))
    out = copy_via_plan({"a": p, "b": [p]})
    assert out["a"] is out["b"][0]  # type: ignore[index]
    assert isinstance(out["a"], torch.nn.Parameter)  # type: ignore[index]


def test_rebuilt_aliasing_matches_the_source() -> None:
    base = torch.randn(4, 4)
    out = copy_via_plan({"w": base, "wt": base.t(), "other": torch.randn(4)})
    assert storage_key(out["w"]) == storage_key(out["wt"])  # type: ignore[index]
    assert storage_key(out["w"]) != storage_key(out["other"])  # type: ignore[index]
    assert out["w"].untyped_storage().nbytes() == base.untyped_storage().nbytes()  # type: ignore[index]


def test_parameter_kind_and_requires_grad_are_planned() -> None:
    plan = plan_state_dict({"p": torch.nn.Parameter(torch.randn(2), requires_grad=False)}).plan
    assert plan.tensors[0].kind is TensorKind.PARAMETER
    assert plan.tensors[0].requires_grad is False


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: torch.empty(3, device="meta"), "meta tensors"),
        (lambda: torch.randn(3, 3).to_sparse(), "layout"),
        (lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]), "nested"),
        (lambda: torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8), "quantized"),
    ],
    ids=["meta", "sparse", "nested", "quantized"],
)
def test_unsupported_tensors_name_their_key_path(make: Callable[[], torch.Tensor], fragment: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that these layouts are prototypes
        value = make()
    with pytest.raises(UnsupportedInputError, match=fragment) as err:
        plan_state_dict({"outer": [{"bad": value}]})
    assert err.value.key_path == ("outer", 0, "bad")
    assert "state_dict['outer'][0]['bad']" in str(err.value)


def test_a_tensor_subclass_is_rejected_not_copied_wrongly() -> None:
    class Mine(torch.Tensor):
        pass

    sub = torch.randn(2).as_subclass(Mine)
    with pytest.raises(UnsupportedInputError, match=r"subclass .*Mine is not supported"):
        plan_state_dict({"x": sub})


def test_a_reference_cycle_is_rejected() -> None:
    loop: dict[str, object] = {}
    loop["self"] = loop
    with pytest.raises(UnsupportedInputError, match="cycle") as err:
        plan_state_dict({"a": loop})
    assert err.value.key_path == ("a", "self")


def test_tensor_dict_keys_are_rejected() -> None:
    with pytest.raises(UnsupportedInputError, match="dict keys"):
        plan_state_dict({"a": {torch.randn(1): 1}})


def test_strict_mode_rejects_arbitrary_leaves() -> None:
    with pytest.raises(UnsupportedInputError, match="type check") as err:
        plan_state_dict({"a": [bytearray(b"x")]}, strict=True)
    assert err.value.key_path == ("a", 0)


def test_uncopyable_leaves_are_rejected_with_their_path() -> None:
    import threading

    with pytest.raises(UnsupportedInputError, match="cannot be copied") as err:
        plan_state_dict({"lock": threading.Lock()})
    assert err.value.key_path == ("lock",)


def test_mutable_leaves_are_copied_at_rebuild() -> None:
    leaf = bytearray(b"abc")
    out = copy_via_plan({"buf": leaf})
    leaf[0] = ord("z")
    assert out["buf"] == bytearray(b"abc")  # type: ignore[index]


def test_conjugate_and_negative_views_keep_their_values() -> None:
    z = torch.randn(3, dtype=torch.complex64)
    out = copy_via_plan({"conj": z.conj(), "neg": torch._neg_view(torch.randn(3)), "z": z})
    assert torch.equal(out["conj"], z.conj())  # type: ignore[index]
    assert out["conj"].is_conj()  # type: ignore[index]


def test_tensor_nodes_are_shared_between_plans_and_right_past_the_shared_range() -> None:
    from astage._staging.plan import SHARED_TENSOR_NODES, TensorNode, tensor_nodes

    nodes = tensor_nodes(5, 9000)
    assert nodes == tuple(TensorNode(i) for i in range(5, 9000))
    assert tensor_nodes(100, 200)[0] is nodes[95]  # one object a position
    end = SHARED_TENSOR_NODES + 3
    assert tensor_nodes(SHARED_TENSOR_NODES - 2, end) == tuple(
        TensorNode(i) for i in range(SHARED_TENSOR_NODES - 2, end)
    )
    assert tensor_nodes(7, 7) == ()
