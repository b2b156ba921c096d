"""Argument checks of ``fully_shard`` and what a successful call leaves behind.

Single process: a "fake" process group of world size 8 (this process is rank
0) lets meshes be built without spawning ranks. Its collectives move no data,
so these tests only look at construction, never at communication.
"""

import copy
import re
import sys
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from dist import fake_world
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import fsdp2
from fsdp2 import FSDPModule, fully_shard

WORLD_SIZE = 8


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 12) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Scaled(nn.Module):
    """Holds a scalar (0-dim) parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class TwoLinears(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        if tie:
            self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def assert_untouched(module: nn.Module, cls: type) -> None:
    """A failed ``fully_shard`` call must leave the module as it found it."""
    assert type(module) is cls
    assert "_fsdp_state" not in module.__dict__
    assert not isinstance(module, FSDPModule)


# -- no process group ------------------------------------------------------
# Defined first: the module-scoped fixture below creates the group lazily, at
# the first test that asks for it, so this test runs before it exists.


def test_default_mesh_without_process_group_raises() -> None:
    assert not dist.is_initialized(), "a test module left a default process group behind"
    model = MLP()
    with pytest.raises(RuntimeError, match=r"not initialised.*init_process_group\(\)"):
        fully_shard(model)
    assert_untouched(model, MLP)


# -- fake world of 8 ranks -------------------------------------------------


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with fake_world(WORLD_SIZE):
        yield init_device_mesh("cpu", (WORLD_SIZE,))


def test_default_mesh_is_on_the_cpu_when_the_accelerator_is_absent(
    mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA build of torch on a host without a GPU: the default mesh is a
    CPU one (the build's accelerator alone would make a CUDA mesh there)."""

    def current_accelerator(check_available: bool = False) -> torch.device | None:
        return None if check_available else torch.device("cuda")

    monkeypatch.setattr(torch.accelerator, "current_accelerator", current_accelerator)
    model = fully_shard(MLP())
    assert {p.device_mesh.device_type for p in model.parameters()} == {"cpu"}


def test_not_a_module_raises(mesh: DeviceMesh) -> None:
    with pytest.raises(TypeError, match=r"expects an nn.Module, got Tensor"):
        fully_shard(torch.ones(3), mesh=mesh)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "container",
    [nn.ModuleList([nn.Linear(4, 4)]), nn.ModuleDict({"a": nn.Linear(4, 4)})],
    ids=["ModuleList", "ModuleDict"],
)
def test_container_without_forward_raises(mesh: DeviceMesh, container: nn.Module) -> None:
    cls = type(container)
    with pytest.raises(
        ValueError,
        match=rf"do not implement forward: {cls.__name__} has none.*fully_shard on each child",
    ):
        fully_shard(container, mesh=mesh)
    assert_untouched(container, cls)


def test_following_the_container_advice_works(mesh: DeviceMesh) -> None:
    model = nn.Sequential(MLP(), MLP())
    layers = nn.ModuleList(model)
    for block in layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(isinstance(m, FSDPModule) for m in [model, *layers])


@pytest.mark.parametrize("bad_mesh", ["cpu", [0, 1, 2, 3], 8], ids=["str", "list", "int"])
def test_mesh_not_a_device_mesh_raises(mesh: DeviceMesh, bad_mesh: object) -> None:
    model = MLP()
    with pytest.raises(
        TypeError,
        match=rf"expects mesh to be a DeviceMesh, got {type(bad_mesh).__name__}.*init_device_mesh",
    ):
        fully_shard(model, mesh=bad_mesh)  # type: ignore[arg-type]
    assert_untouched(model, MLP)


def test_2d_mesh_without_names_and_non_contiguous_params_raise_torchs_types(
    mesh: DeviceMesh,
) -> None:
    """As torch's fully_shard: AssertionError for an HSDP mesh without axis
    names, NotImplementedError for a non-contiguous (channels_last) weight."""
    model = MLP()
    with pytest.raises(AssertionError, match=r"2D mesh for HSDP with mesh_dim_names specified"):
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 4)))
    assert_untouched(model, MLP)
    conv = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    with pytest.raises(
        NotImplementedError,
        match=r"non-contiguous parameters: 'weight' has shape \(8, 8, 3, 3\) and strides "
        r"\(72, 1, 24, 8\).*contiguous_format",
    ):
        fully_shard(conv, mesh=mesh)
    assert_untouched(conv, nn.Conv2d)


def test_2d_mesh_named_shard_first_warns(mesh: DeviceMesh) -> None:
    """A 2D mesh is taken by position (replicate, shard); axes named the other
    way round get a warning naming what happens and the mesh to pass instead.
    Named the usual way, or with other names, no warning."""
    backwards = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp_shard", "dp_replicate"))
    with pytest.warns(
        UserWarning,
        match=re.escape(
            "replicated over 'dp_shard' and sharded over 'dp_replicate'. If that is not what "
            "you meant, pass mesh['dp_replicate', 'dp_shard'] (replicate first, then shard)."
        ),
    ):
        fully_shard(MLP(), mesh=backwards)
    for names in (("replicate", "shard"), ("dp_replicate", "dp_shard"), ("a", "b")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fully_shard(MLP(), mesh=init_device_mesh("cpu", (2, 4), mesh_dim_names=names))


def test_3d_mesh_raises_and_2d_hsdp_and_1d_submesh_work(mesh: DeviceMesh) -> None:
    mesh_3d = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "replicate", "dp"))
    model = MLP()
    with pytest.raises(
        ValueError, match=r"expects a 1D or 2D DeviceMesh .* 3D with shape \(2, 2, 2\)"
    ):
        fully_shard(model, mesh=mesh_3d)
    assert_untouched(model, MLP)

    # The fix the message suggests: pass the data-parallel sub-mesh, 1D or 2D (HSDP).
    orig = model.up.weight.detach().clone()
    fully_shard(model.up, mesh=mesh_3d["replicate", "dp"])
    assert model.up.weight.placements == (Replicate(), Shard(0))
    assert torch.equal(model.up.weight.to_local(), torch.chunk(orig, 2)[0])
    fully_shard(model, mesh=mesh_3d["dp"])
    assert model.down.weight.device_mesh == mesh_3d["dp"]


@pytest.mark.parametrize("value", ["yes", 0.0, 2.0], ids=repr)
def test_reshard_after_forward_wrong_type_raises(mesh: DeviceMesh, value: object) -> None:
    model = MLP()
    with pytest.raises(
        TypeError, match=r"reshard_after_forward must be True, False, None or an int"
    ):
        fully_shard(model, mesh=mesh, reshard_after_forward=value)  # type: ignore[arg-type]
    assert_untouched(model, MLP)


@pytest.mark.parametrize("value", [0, 3, 16, -2], ids=repr)
def test_reshard_after_forward_int_not_divisor_raises(mesh: DeviceMesh, value: int) -> None:
    model = MLP()
    with pytest.raises(
        ValueError, match=rf"reshard_after_forward={value} must divide the mesh size 8"
    ):
        fully_shard(model, mesh=mesh, reshard_after_forward=value)
    assert_untouched(model, MLP)


@pytest.mark.parametrize("value", [True, False, None, 1, 8])
def test_reshard_after_forward_accepts_bool_or_none(mesh: DeviceMesh, value: bool | None) -> None:
    assert isinstance(fully_shard(MLP(), mesh=mesh, reshard_after_forward=value), FSDPModule)


def test_sharding_twice_raises(mesh: DeviceMesh) -> None:
    model = fully_shard(MLP(), mesh=mesh)
    line = sys._getframe().f_lineno - 1
    cls = type(model)
    site = rf"\S*test_validation\.py:{line}"
    with pytest.raises(
        ValueError,
        match=rf"this MLP is already sharded by the fully_shard call at {site}\. .*once per module",
    ):
        fully_shard(model, mesh=mesh)
    assert type(model) is cls


def test_scalar_parameter_raises_naming_it(mesh: DeviceMesh) -> None:
    model = nn.Sequential(nn.Linear(4, 4), Scaled())
    with pytest.raises(
        ValueError,
        match=r"does not support scalar parameters: '1\.scale' is 0-dimensional\. Change 1\.scale "
        r"to a 1D tensor.*torch\.ones\(1\)",
    ):
        fully_shard(model, mesh=mesh)
    assert_untouched(model, nn.Sequential)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_dtensor_parameter_raises(mesh: DeviceMesh) -> None:
    model = MLP()
    model.up.weight = nn.Parameter(DTensor.from_local(torch.randn(2, 16), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match=r"parameter 'up\.weight' is already a DTensor"):
        fully_shard(model, mesh=mesh)
    assert_untouched(model, MLP)


def test_top_down_order_raises_on_the_child(mesh: DeviceMesh) -> None:
    """Sharding the parent first turns the child's parameters into DTensors."""
    model = nn.Sequential(MLP(), MLP())
    fully_shard(model, mesh=mesh)
    with pytest.raises(ValueError, match=r"parameter 'up\.weight' is already a DTensor"):
        fully_shard(model[0], mesh=mesh)
    assert_untouched(model[0], MLP)


def test_meta_parameters_stay_on_meta_until_to_empty(mesh: DeviceMesh) -> None:
    with torch.device("meta"):
        model = MLP()
    fully_shard(model, mesh=mesh)
    assert all(p.to_local().is_meta and p.shape == (12, 16) for p in (model.up.weight,))
    model.to_empty(device="cpu")
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in model.parameters())
    assert model.up.weight.to_local().shape == torch.chunk(torch.empty(12, 16), 8)[0].shape


def test_param_tied_across_groups_after_sharding_raises(mesh: DeviceMesh) -> None:
    """``b`` picks up ``a``'s already-sharded parameter, then the parent is sharded."""
    model = TwoLinears(tie=False)
    fully_shard(model.a, mesh=mesh)
    model.b.weight = model.a.weight
    with pytest.raises(
        ValueError,
        match=r"parameter 'b\.weight' is the same Parameter as 'a\.weight'.*already sharded",
    ):
        fully_shard(model, mesh=mesh)
    assert_untouched(model, TwoLinears)


def test_param_tied_across_groups_before_sharding_raises(mesh: DeviceMesh) -> None:
    model = TwoLinears(tie=True)
    fully_shard(model.a, mesh=mesh)
    with pytest.raises(ValueError, match=r"'b\.weight' is the same Parameter as 'a\.weight'"):
        fully_shard(model, mesh=mesh)


# -- what a successful call leaves behind ----------------------------------


def test_returns_same_module_with_generated_class(mesh: DeviceMesh) -> None:
    model = MLP()
    assert fully_shard(model, mesh=mesh) is model
    cls = type(model)
    assert cls.__name__ == "FSDPMLP"
    assert issubclass(cls, FSDPModule) and issubclass(cls, MLP)
    assert isinstance(model, fsdp2.FSDPModule) and isinstance(model, MLP)


def test_same_class_shares_one_generated_class(mesh: DeviceMesh) -> None:
    a, b = nn.Linear(4, 4), nn.Linear(8, 2)
    fully_shard(a, mesh=mesh)
    fully_shard(b, mesh=mesh)
    assert type(a) is type(b)
    assert type(a).__name__ == "FSDPLinear"
    assert type(fully_shard(MLP(), mesh=mesh)) is not type(a)


@pytest.mark.parametrize(
    "shape",
    [(16, 12), (12,), (5, 3), (3,), (1, 7), (9, 2, 3), (0, 4)],
    ids=str,
)
def test_parameters_become_shard0_dtensors(mesh: DeviceMesh, shape: tuple[int, ...]) -> None:
    """Rank 0 holds exactly ``torch.chunk(orig, 8)[0]``, including when dim 0 < 8."""
    model = nn.Linear(1, 1)
    model.weight = nn.Parameter(torch.randn(shape))
    orig = model.weight.detach().clone()
    fully_shard(model, mesh=mesh)

    param = model.weight
    assert isinstance(param, nn.Parameter) and isinstance(param, DTensor)
    assert param.placements == (Shard(0),)
    assert param.device_mesh == mesh
    assert param.shape == orig.shape
    assert param.requires_grad
    assert torch.equal(param.to_local(), torch.chunk(orig, WORLD_SIZE)[0])
    assert dict(model.named_parameters()).keys() == {"weight", "bias"}


def test_frozen_parameters_stay_frozen(mesh: DeviceMesh) -> None:
    model = MLP()
    model.up.weight.requires_grad_(False)
    fully_shard(model, mesh=mesh)
    assert isinstance(model.up.weight, DTensor)
    assert not model.up.weight.requires_grad
    assert model.up.bias.requires_grad and model.down.weight.requires_grad


def test_tied_parameters_in_one_group_stay_tied(mesh: DeviceMesh) -> None:
    model = TwoLinears(tie=True)
    orig = model.a.weight.detach().clone()
    fully_shard(model, mesh=mesh)
    assert model.a.weight is model.b.weight
    assert isinstance(model.a.weight, DTensor)
    assert torch.equal(model.a.weight.to_local(), torch.chunk(orig, WORLD_SIZE)[0])
    # Deduplicated, as nn.Module.parameters() does for tied parameters.
    assert len(list(model.parameters())) == 3


def test_deepcopy_works_before_and_raises_after(mesh: DeviceMesh) -> None:
    model = MLP()
    clone = copy.deepcopy(model)
    assert type(clone) is MLP and clone.up.weight is not model.up.weight

    fully_shard(model, mesh=mesh)
    with pytest.raises(
        AssertionError, match=r"deepcopy of a sharded module \(FSDPMLP\).*state_dict"
    ):
        copy.deepcopy(model)


def test_deepcopy_of_unsharded_parent_of_sharded_child_raises(mesh: DeviceMesh) -> None:
    model = nn.Sequential(MLP(), nn.Linear(16, 4))
    fully_shard(model[0], mesh=mesh)
    with pytest.raises(AssertionError, match=r"deepcopy of a sharded module \(FSDPMLP\)"):
        copy.deepcopy(model)


# -- shard_placement_fn ----------------------------------------------------


def _params_by_name(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters())


def assert_params_unchanged(model: nn.Module, before: dict[str, nn.Parameter]) -> None:
    """The same Parameter objects as before the failed call."""
    after = _params_by_name(model)
    assert after.keys() == before.keys()
    for name, param in after.items():
        assert param is before[name], f"{name} was replaced"


def _place(placements: dict[str, object], model: nn.Module) -> Callable[[nn.Parameter], object]:
    """A shard_placement_fn returning ``placements[name]`` (None if absent)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return lambda param: placements.get(names[id(param)])


@pytest.mark.parametrize("fn", [Shard(1), 1, "Shard(1)"], ids=repr)
def test_shard_placement_fn_not_callable_raises(mesh: DeviceMesh, fn: object) -> None:
    model = MLP()
    before = _params_by_name(model)
    with pytest.raises(
        TypeError,
        match=rf"shard_placement_fn must be a function param -> Shard\(dim\) \| "
        rf"ShardPlacementResult \| None, got {type(fn).__name__}",
    ):
        fully_shard(model, mesh=mesh, shard_placement_fn=fn)  # type: ignore[arg-type]
    assert_untouched(model, MLP)
    assert_params_unchanged(model, before)


@pytest.mark.parametrize(
    "placement",
    [Replicate(), Partial(), 1, _StridedShard(1, split_factor=2)],
    ids=["Replicate", "Partial", "int", "_StridedShard"],
)
def test_shard_placement_fn_returning_non_shard_raises(mesh: DeviceMesh, placement: object) -> None:
    """Only Shard itself (not a subclass such as _StridedShard) or None."""
    model = MLP()
    before = _params_by_name(model)
    with pytest.raises(
        TypeError,
        match=rf"shard_placement_fn returned {re.escape(repr(placement))} for 'down\.weight'; "
        r"it must return torch\.distributed\.tensor\.Shard\(dim\), "
        r"fsdp2\.ShardPlacementResult\(placement, mesh\) or None",
    ):
        fully_shard(model, mesh=mesh, shard_placement_fn=_place({"down.weight": placement}, model))
    assert_untouched(model, MLP)
    assert_params_unchanged(model, before)


@pytest.mark.parametrize(
    ("name", "dim", "ndim", "shape"),
    [
        ("up.weight", 2, 2, (12, 16)),
        ("up.weight", -3, 2, (12, 16)),
        ("up.bias", 1, 1, (12,)),
        ("down.bias", -2, 1, (16,)),
    ],
    ids=["2 of 2D", "-3 of 2D", "1 of 1D", "-2 of 1D"],
)
def test_shard_placement_fn_dim_out_of_range_raises(
    mesh: DeviceMesh, name: str, dim: int, ndim: int, shape: tuple[int, ...]
) -> None:
    model = MLP()
    before = _params_by_name(model)
    with pytest.raises(
        AssertionError,  # torch's type
        match=rf"Shard dim {dim} is invalid for {ndim}D tensor {re.escape(repr(name))} "
        rf"\(shape {re.escape(str(shape))}\).*Return a dim in \[-{ndim}, {ndim}\)",
    ):
        fully_shard(model, mesh=mesh, shard_placement_fn=_place({name: Shard(dim)}, model))
    assert_untouched(model, MLP)
    assert_params_unchanged(model, before)


@pytest.mark.parametrize(
    ("shape", "dim", "resolved", "size"),
    [((16, 12), 1, 1, 12), ((16, 12), -1, 1, 12), ((2, 12, 8), 1, 1, 12), ((2, 8, 4), 2, 2, 4)],
    ids=["dim 1", "dim -1", "3D dim 1", "3D dim 2 smaller than the world"],
)
def test_shard_placement_fn_uneven_dim_raises_naming_size_and_world(
    mesh: DeviceMesh, shape: tuple[int, ...], dim: int, resolved: int, size: int
) -> None:
    """A dim > 0 must split evenly over the 8 ranks; the message names the
    parameter, the dim (resolved), its size and the world size."""
    model = MLP()
    model.down.weight = nn.Parameter(torch.randn(shape))
    before = _params_by_name(model)
    with pytest.raises(
        NotImplementedError,  # torch's type
        match=rf"uneven sharding on dim {resolved}: 'down\.weight' has size {size} there "
        rf"\(shape {re.escape(str(shape))}\), which does not split evenly over 8 ranks",
    ):
        fully_shard(model, mesh=mesh, shard_placement_fn=_place({"down.weight": Shard(dim)}, model))
    assert_untouched(model, MLP)
    assert_params_unchanged(model, before)


def test_shard_placement_fn_evenness_is_over_the_shard_group(mesh: DeviceMesh) -> None:
    """HSDP on (2, 4): a dim of 12 splits over the 4 ranks of the shard group
    (not the 8 of the mesh); one of 6 does not, and the message says 4 ranks."""
    hsdp = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    model = MLP()  # down.weight is (16, 12)
    model.up.weight = nn.Parameter(torch.randn(12, 6))
    with pytest.raises(NotImplementedError, match=r"'up\.weight' has size 6 there .* 4 ranks"):
        fully_shard(model, mesh=hsdp, shard_placement_fn=_place({"up.weight": Shard(1)}, model))
    assert_untouched(model, MLP)

    orig = model.down.weight.detach().clone()
    fully_shard(model, mesh=hsdp, shard_placement_fn=_place({"down.weight": Shard(1)}, model))
    param = model.down.weight
    assert param.placements == (Replicate(), Shard(1))
    assert torch.equal(param.to_local(), torch.chunk(orig, 4, dim=1)[hsdp.get_local_rank(1)])
    assert model.up.weight.placements == (Replicate(), Shard(0))


def test_shard_placement_fn_places_params_and_cuts_chunks_on_their_dim(mesh: DeviceMesh) -> None:
    """Rank 0 of 8 holds ``torch.chunk(orig, 8, dim=d)[0]``, contiguous; a
    negative dim is resolved; None and Shard(0) give dim 0, uneven there too.
    The function sees each original parameter once."""
    model = MLP(dim=16, hidden=24)  # up.weight (24, 16), down.weight (16, 24)
    model.up.bias = nn.Parameter(torch.randn(3))  # shorter than the world on dim 0
    orig = {name: p.detach().clone() for name, p in model.named_parameters()}
    originals = set(map(id, model.parameters()))
    placements = {"up.weight": Shard(1), "down.weight": Shard(-1), "up.bias": Shard(0)}
    seen = []
    names = {id(p): n for n, p in model.named_parameters()}

    def placement(param: nn.Parameter) -> Shard | None:
        assert id(param) in originals and not isinstance(param, DTensor)
        seen.append(names[id(param)])
        return placements.get(names[id(param)])

    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    assert sorted(seen) == sorted(orig)
    dims = {"up.weight": 1, "down.weight": 1, "up.bias": 0, "down.bias": 0}
    for name, param in model.named_parameters():
        dim = dims[name]
        assert param.placements == (Shard(dim),), f"{name}: {param.placements}"
        assert param.shape == orig[name].shape
        local = param.to_local()
        assert local.is_contiguous(), name
        assert torch.equal(local, torch.chunk(orig[name], WORLD_SIZE, dim=dim)[0]), name


def test_load_state_dict_cuts_full_tensors_on_the_shard_dim(mesh: DeviceMesh) -> None:
    """The load pre-hook cuts a full tensor on the parameter's dim (no
    communication: checkable with the fake group); state_dict() returns the
    Shard(d) DTensors."""
    model = MLP(dim=16, hidden=24)
    fully_shard(model, mesh=mesh, shard_placement_fn=_place({"up.weight": Shard(1)}, model))
    torch.manual_seed(1)
    full = MLP(dim=16, hidden=24).state_dict()
    model.load_state_dict(full)
    state = model.state_dict()
    assert state["up.weight"].placements == (Shard(1),)
    assert state["down.weight"].placements == (Shard(0),)
    for name, param in model.named_parameters():
        dim = 1 if name == "up.weight" else 0
        assert torch.equal(param.to_local(), torch.chunk(full[name], WORLD_SIZE, dim=dim)[0]), name


# -- DTensor (tensor-parallel) parameters ----------------------------------


@pytest.fixture(scope="module")
def dp_tp(mesh: DeviceMesh) -> DeviceMesh:
    """(dp=2, tp=4) over the fake world: rank 0's mesh["dp"] is ranks (0, 4),
    its mesh["tp"] ranks (0, 1, 2, 3)."""
    return init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))


def _with_tp_weight(tp_mesh: DeviceMesh, placement: object, shape=(12, 16)) -> MLP:
    """An MLP whose up.weight is a DTensor on ``tp_mesh`` (local shape ``shape``)."""
    model = MLP()
    local = torch.randn(shape)
    model.up.weight = nn.Parameter(DTensor.from_local(local, tp_mesh, [placement], run_check=False))
    return model


def test_partial_tp_parameter_raises(dp_tp: DeviceMesh) -> None:
    model = _with_tp_weight(dp_tp["tp"], Partial())
    before = _params_by_name(model)
    with pytest.raises(
        ValueError,
        match=r"parameter 'up\.weight' is a DTensor placed \(Partial\(sum\),\); only "
        r"Shard\(dim\) and Replicate\(\) tensor-parallel placements",
    ):
        fully_shard(model, mesh=dp_tp["dp"])
    assert_untouched(model, MLP)
    assert_params_unchanged(model, before)


@pytest.mark.parametrize("which", ["tp passed as the dp mesh", "same ranks, another mesh"])
def test_dtensor_on_the_ranks_of_the_mesh_raises(
    dp_tp: DeviceMesh, mesh: DeviceMesh, which: str
) -> None:
    """A DTensor on the very ranks fully_shard shards over: the mesh passed is
    the TP mesh itself, or a separately built mesh of the same ranks."""
    model = _with_tp_weight(dp_tp["tp"], Shard(0))
    before = _params_by_name(model)
    fsdp_mesh = dp_tp["tp"] if which.startswith("tp") else DeviceMesh("cpu", [0, 1, 2, 3])
    with pytest.raises(
        ValueError,
        match=r"parameter 'up\.weight' is already a DTensor on the ranks of the mesh passed "
        r"to fully_shard \(\(Shard\(dim=0\),\) on .*parallelize over mesh\['tp'\] and "
        r"shard over mesh\['dp'\]",
    ):
        fully_shard(model, mesh=fsdp_mesh)
    assert_untouched(model, MLP)
    assert_params_unchanged(model, before)


@pytest.mark.parametrize(
    "which", ["the whole world", "a separate mesh of the dp ranks", "overlapping slices"]
)
def test_tp_mesh_not_an_orthogonal_slice_raises(
    dp_tp: DeviceMesh, mesh: DeviceMesh, which: str
) -> None:
    """The dp mesh and the parameter's mesh must be named slices of one root
    mesh with no axis in common."""
    if which == "the whole world":
        tp_mesh, dp_mesh = dp_tp["tp"], mesh
    elif which == "a separate mesh of the dp ranks":
        tp_mesh, dp_mesh = dp_tp["tp"], DeviceMesh("cpu", [0, 4])
    else:
        mesh_3d = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        tp_mesh, dp_mesh = mesh_3d["b", "c"], mesh_3d["a", "b"]
    model = _with_tp_weight(tp_mesh, Shard(0))
    before = _params_by_name(model)
    with pytest.raises(
        ValueError,
        match=r"fully_shard over tensor parallelism needs the data-parallel mesh .* and the "
        r"parameters' TP mesh .* to be named slices of one mesh",
    ):
        fully_shard(model, mesh=dp_mesh)
    assert_untouched(model, MLP)
    assert_params_unchanged(model, before)


def test_tp_parameter_placed_on_the_joined_mesh(dp_tp: DeviceMesh) -> None:
    """Sharding the TP-local tensor over dp: a dim TP also shards is a strided
    shard; shard_placement_fn's dim (checked for evenness on the TP-local size)
    gives (Shard(d), tp placement). Rank 0 holds torch.chunk's piece of its TP
    shard."""
    model = _with_tp_weight(dp_tp["tp"], Shard(0))
    local = model.up.weight.to_local().detach().clone()
    fully_shard(model, mesh=dp_tp["dp"])
    param = model.up.weight
    assert param.device_mesh.mesh_dim_names == ("dp", "tp")
    assert param.placements == (_StridedShard(0, split_factor=4), Shard(0))
    assert torch.equal(param.to_local(), torch.chunk(local, 2)[0])

    model = _with_tp_weight(dp_tp["tp"], Shard(0))
    local = model.up.weight.to_local().detach().clone()
    fully_shard(model, mesh=dp_tp["dp"], shard_placement_fn=_place({"up.weight": Shard(1)}, model))
    assert model.up.weight.placements == (Shard(1), Shard(0))
    assert torch.equal(model.up.weight.to_local(), torch.chunk(local, 2, dim=1)[0])

    # TP-local (12, 3) of a (12, 12) weight sharded on dim 1: 3 does not split over 2.
    model = _with_tp_weight(dp_tp["tp"], Shard(1), shape=(12, 3))
    with pytest.raises(NotImplementedError, match=r"'up\.weight' has size 3 there .* over 2 ranks"):
        fully_shard(
            model, mesh=dp_tp["dp"], shard_placement_fn=_place({"up.weight": Shard(1)}, model)
        )
    assert_untouched(model, MLP)


def test_reshard_after_forward_int_on_a_mesh_slice_raises(mesh: DeviceMesh) -> None:
    """The small post-forward groups are created by every rank of the world; a dp
    slice of a (dp, tp) mesh cannot describe them all, so the int is refused."""
    mesh_2d = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    model = MLP()
    with pytest.raises(
        ValueError, match=r"reshard_after_forward=2 needs a mesh over every rank.*4 of 8 ranks"
    ):
        fully_shard(model, mesh=mesh_2d["dp"], reshard_after_forward=2)
    assert_untouched(model, MLP)
    fully_shard(model, mesh=mesh_2d["dp"], reshard_after_forward=True)  # a bool is fine


# -- strict booleans ---------------------------------------------------------
# A config value such as "false" is truthy: taken as a bool it would turn the
# option on. Every boolean argument refuses anything but True and False.

# Refused where a flag is expected: torch reads "false" (and b"") as True or
# False by length, not by what it says; a list there is a misplaced value.
# torch's other readings are taken (test_flags_take_torchs_values_with_its_meaning).
NOT_BOOLS = ["false", b"1", [1]]
# What torch gives a meaning to in a flag's place: its truth value.
TORCH_FLAGS = [1, 0, None, np.True_, np.False_, np.int64(1), 0.0, 2.5]


def _not_a_bool(where: str, name: str, value: object) -> str:
    """The message for ``value`` given as ``where(name=value)``."""
    return re.escape(
        f"{where}({name}=...) takes True or False, got {type(value).__name__} {value!r}. "
        f"Pass {name}=True or {name}=False; convert a config value first (bool('false') is True)."
    )


@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
def test_shard_optimizer_over_replicas_takes_only_a_bool(mesh: DeviceMesh, value: object) -> None:
    model = MLP()
    with pytest.raises(
        TypeError, match=_not_a_bool("fully_shard", "shard_optimizer_over_replicas", value)
    ):
        fully_shard(model, mesh=mesh, shard_optimizer_over_replicas=value)  # type: ignore[arg-type]
    assert_untouched(model, MLP)


@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
def test_policy_flags_take_only_a_bool(value: object) -> None:
    match = _not_a_bool("MixedPrecisionPolicy", "cast_forward_inputs", value)
    with pytest.raises(TypeError, match=match):
        fsdp2.MixedPrecisionPolicy(cast_forward_inputs=value)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=_not_a_bool("CPUOffloadPolicy", "pin_memory", value)):
        fsdp2.CPUOffloadPolicy(pin_memory=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype"])
def test_policy_dtypes_are_checked_where_given(mesh: DeviceMesh, field: str) -> None:
    """A dtype given as a config string fails in the policy (fsdp2's) or in
    fully_shard (torch's, converted), naming the dtype meant; a dtype that is
    not floating point is refused too. Before, "bf16" failed at the first
    forward ("Invalid device string: 'bf16'")."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

    cases = [
        ("bf16", TypeError, "got str 'bf16': use torch.bfloat16"),
        ("torch.float16", TypeError, "got str 'torch.float16': use torch.float16"),
        (16, TypeError, "got int 16: use a torch.dtype such as torch.bfloat16"),
        (torch.int8, ValueError, "takes a floating-point dtype, got torch.int8"),
    ]
    for value, error, message in cases:
        match = re.escape(f"MixedPrecisionPolicy({field}=...) ") + ".*" + re.escape(message)
        with pytest.raises(error, match=match):
            fsdp2.MixedPrecisionPolicy(**{field: value})
        model = MLP()
        with pytest.raises(error, match=match):
            fully_shard(model, mesh=mesh, mp_policy=TorchMixedPrecisionPolicy(**{field: value}))
        assert_untouched(model, MLP)
    for good in (None, torch.bfloat16, torch.float32):
        assert getattr(fsdp2.MixedPrecisionPolicy(**{field: good}), field) is good


# (setter, its boolean arguments): each is called with one of them wrong, the others True.
BOOL_SETTERS = [
    ("unshard", ["async_op"]),
    ("set_reshard_after_forward", ["reshard_after_forward", "recurse"]),
    ("set_reshard_after_backward", ["reshard_after_backward", "recurse"]),
    ("set_requires_gradient_sync", ["requires_gradient_sync", "recurse"]),
    ("set_requires_all_reduce", ["requires_all_reduce", "recurse"]),
    ("set_is_last_backward", ["is_last_backward"]),
    ("set_check_execution_order", ["enabled"]),
    ("set_force_sum_reduction_for_comms", ["enable"]),
    ("set_reduce_scatter_unused_params", ["reduce_scatter_unused_params", "recurse"]),
    ("set_separate_reduce_scatter_group", ["enable", "recurse"]),
    ("set_unshard_in_backward", ["unshard_in_backward"]),
]


@pytest.mark.parametrize(
    ("setter", "name"),
    [(setter, name) for setter, names in BOOL_SETTERS for name in names],
)
@pytest.mark.parametrize("value", ["false", b"1"], ids=repr)
def test_fsdp_module_setters_take_only_a_bool(
    mesh: DeviceMesh, setter: str, name: str, value: object
) -> None:
    model = fully_shard(MLP(), mesh=mesh)
    names = dict(BOOL_SETTERS)[setter]
    kwargs: dict[str, object] = {other: True for other in names}
    kwargs[name] = value
    with pytest.raises(TypeError, match=_not_a_bool(setter, name, value)):
        getattr(model, setter)(**kwargs)


def _settings(model: nn.Module) -> dict[str, object]:
    """What the setters change: the plain fields of the model's state, groups,
    root context and reduction pipeline."""
    state = model._fsdp_state  # type: ignore[attr-defined]
    owners = {"state": state, "root": state.root_ctx, "reductions": state.root_ctx.reductions}
    owners |= {f"group {i}": group for i, group in enumerate(state.param_groups)}
    plain = (bool, int, float, str, type(None))
    return {
        f"{owner}.{name}": value
        for owner, obj in owners.items()
        for name, value in vars(obj).items()
        if isinstance(value, plain) and name != "call_site"
    }


@pytest.mark.parametrize(
    ("setter", "name"),
    [(setter, name) for setter, names in BOOL_SETTERS for name in names],
)
@pytest.mark.parametrize("value", TORCH_FLAGS, ids=repr)
def test_flags_take_torchs_values_with_its_meaning(
    mesh: DeviceMesh, setter: str, name: str, value: object
) -> None:
    """Where torch's setter takes ``value`` (it reads its truth value), fsdp2's
    takes it with that meaning: the same settings as the bool. torch's
    set_reshard_after_forward takes only a bool, and so does fsdp2's."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    names = dict(BOOL_SETTERS)[setter]
    kwargs: dict[str, object] = {other: True for other in names}
    kwargs[name] = value
    torch_model = torch_fully_shard(MLP(), mesh=mesh)
    strict = (setter, name) == ("set_reshard_after_forward", "reshard_after_forward")
    if hasattr(torch_model, setter):
        if strict:
            with pytest.raises(ValueError, match="should be a bool"):
                getattr(torch_model, setter)(**kwargs)
        else:
            getattr(torch_model, setter)(**kwargs)  # torch takes it
    model = fully_shard(MLP(), mesh=mesh)
    if strict:
        with pytest.raises(TypeError, match=re.escape(f"{setter}({name}=...) takes True or False")):
            getattr(model, setter)(**kwargs)
        return
    getattr(model, setter)(**kwargs)
    expected = fully_shard(MLP(), mesh=mesh)
    getattr(expected, setter)(**kwargs | {name: bool(value)})
    assert _settings(model) == _settings(expected)


@pytest.mark.parametrize("value", TORCH_FLAGS, ids=repr)
def test_policy_flags_take_torchs_values_with_its_meaning(value: object) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchOffload
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    policy = fsdp2.MixedPrecisionPolicy(cast_forward_inputs=value)  # type: ignore[arg-type]
    assert policy == fsdp2.MixedPrecisionPolicy(cast_forward_inputs=bool(value))
    offload = fsdp2.CPUOffloadPolicy(pin_memory=value)  # type: ignore[arg-type]
    assert offload == fsdp2.CPUOffloadPolicy(pin_memory=bool(value))
    # torch's, as torch builds them, converted with torch's meaning
    converted = fsdp2.base.policy.from_torch_policy(TorchPolicy(cast_forward_inputs=value))
    assert converted == fsdp2.MixedPrecisionPolicy(cast_forward_inputs=bool(value))
    converted = fsdp2.base.policy.from_torch_policy(TorchOffload(pin_memory=value))
    assert converted == fsdp2.CPUOffloadPolicy(pin_memory=bool(value))


@pytest.mark.parametrize("value", TORCH_FLAGS, ids=repr)
def test_fully_shard_flags_take_torchs_values(mesh: DeviceMesh, value: object) -> None:
    """shard_optimizer_over_replicas (fsdp2's own flag) reads flags as the rest."""
    hsdp = init_device_mesh("cpu", (2, WORLD_SIZE // 2), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(MLP(), mesh=hsdp, shard_optimizer_over_replicas=value)  # type: ignore[arg-type]
    assert model._fsdp_state.param_groups[0].settings.over_replicas is bool(value)


def test_divide_factor_takes_torchs_numbers_and_none(mesh: DeviceMesh) -> None:
    """torch's set_gradient_divide_factor takes numpy numbers and one-element
    tensors, and None for its default again; fsdp2's too. Zero, negatives and
    strings are refused (torch fails or trains wrong with them)."""
    model = fully_shard(MLP(), mesh=mesh)
    group = model._fsdp_state.param_groups[0]
    for factor in (np.int64(4), torch.tensor(4.0), 4, 4.0):
        model.set_gradient_divide_factor(factor)  # type: ignore[arg-type]
        assert group.gradient_divide_factor == 4.0 and type(group.gradient_divide_factor) is float
    model.set_gradient_divide_factor(None)
    assert group.gradient_divide_factor is None
    model.set_gradient_divide_factor(True)  # type: ignore[arg-type]  (torch reads it as 1)
    assert group.gradient_divide_factor == 1.0
    for bad in (0, -2.0, "2"):
        with pytest.raises(ValueError, match="expects a positive number or None"):
            model.set_gradient_divide_factor(bad)  # type: ignore[arg-type]


def test_none_clears_or_means_nothing_as_in_torch(mesh: DeviceMesh) -> None:
    """set_all_reduce_hook(None) removes the hook; set_post_optim_event(None) is
    no event (also on CPU); a CPU stream for the hook is the one CPU stream;
    torch's DataParallelMeshDims is taken as fsdp2's."""
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

    model = fully_shard(MLP(), mesh=mesh)
    group = model._fsdp_state.param_groups[0]
    model.set_all_reduce_hook(lambda output: None, stream=torch.cpu.current_stream())
    assert group.all_reduce_hook is not None and group.all_reduce_hook_stream is None
    model.set_all_reduce_hook(None)
    assert group.all_reduce_hook is None
    model.set_post_optim_event(None)
    named = init_device_mesh("cpu", (WORLD_SIZE,), mesh_dim_names=("dp",))
    spmd = MLP()
    for module in spmd.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = DTensor.from_local(param.detach(), named, [Replicate()])
            setattr(module, name, nn.Parameter(replicated))
    sharded = fully_shard(spmd, mesh=named, dp_mesh_dims=TorchDims(shard="dp"))
    assert sharded._fsdp_state.param_groups[0].mesh_info.shard_world_size == WORLD_SIZE


def test_ignored_params_as_one_parameter_is_refused(mesh: DeviceMesh) -> None:
    """torch matches a bare Parameter passed as ignored_params by its elements'
    values (silently wrong); fsdp2 asks for the set, which it takes as a list
    or tuple too."""
    model = MLP()
    with pytest.raises(TypeError, match=r"takes a set of parameters, got one Parameter of shape"):
        fully_shard(model, mesh=mesh, ignored_params=model.up.weight)  # type: ignore[arg-type]
    assert_untouched(model, MLP)
    listed = MLP()
    fully_shard(listed, mesh=mesh, ignored_params=[listed.up.weight])  # type: ignore[arg-type]
    assert not isinstance(listed.up.weight, DTensor) and isinstance(listed.down.weight, DTensor)


def test_max_input_buffers_recurse_takes_only_a_bool(mesh: DeviceMesh) -> None:
    model = fully_shard(MLP(), mesh=mesh)
    match = _not_a_bool("set_reduce_scatter_max_input_buffers", "recurse", "yes")
    with pytest.raises(TypeError, match=match):
        model.set_reduce_scatter_max_input_buffers(2, recurse="yes")  # type: ignore[arg-type]


def test_fsdp_module_setters_take_true_and_false(mesh: DeviceMesh) -> None:
    model = fully_shard(MLP(), mesh=mesh)
    for flag in (True, False):
        model.set_reshard_after_forward(flag, recurse=flag)
        model.set_reshard_after_backward(flag, recurse=flag)
        model.set_requires_gradient_sync(flag, recurse=flag)
        model.set_requires_all_reduce(flag, recurse=flag)
        model.set_is_last_backward(flag)
        model.set_force_sum_reduction_for_comms(flag)
        model.set_reduce_scatter_unused_params(flag, recurse=flag)
        model.set_unshard_in_backward(flag)
    assert model._fsdp_state.param_groups[0].requires_gradient_sync is False
