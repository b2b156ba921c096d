"""Argument checks of ``fully_shard`` and what a successful call leaves behind.

Single process: a "fake" process group of world size 8 (this process is rank
0) lets meshes be built without spawning ranks. Its collectives move no data,
so these tests only look at construction, never at communication.
"""

import copy
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

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
    assert not dist.is_initialized(), "a test module left a default process group behind"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    try:
        yield init_device_mesh("cpu", (WORLD_SIZE,))
    finally:
        dist.destroy_process_group()


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
        match=rf"does not support {cls.__name__}: it has no forward.*fully_shard on each child",
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


def test_3d_mesh_raises_and_2d_hsdp_and_1d_submesh_work(mesh: DeviceMesh) -> None:
    mesh_3d = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "replicate", "dp"))
    model = MLP()
    with pytest.raises(ValueError, match=r"got a 3D mesh with shape \(2, 2, 2\)"):
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
    cls = type(model)
    with pytest.raises(ValueError, match=r"MLP is already sharded by fully_shard.*once per module"):
        fully_shard(model, mesh=mesh)
    assert type(model) is cls


def test_scalar_parameter_raises_naming_it(mesh: DeviceMesh) -> None:
    model = nn.Sequential(nn.Linear(4, 4), Scaled())
    with pytest.raises(
        ValueError,
        match=r"does not support scalar parameters: '1\.scale' is 0-dimensional.*torch\.ones\(1\)",
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
    with pytest.raises(RuntimeError, match=r"deepcopy of a sharded module \(FSDPMLP\).*state_dict"):
        copy.deepcopy(model)


def test_deepcopy_of_unsharded_parent_of_sharded_child_raises(mesh: DeviceMesh) -> None:
    model = nn.Sequential(MLP(), nn.Linear(16, 4))
    fully_shard(model[0], mesh=mesh)
    with pytest.raises(RuntimeError, match=r"deepcopy of a sharded module \(FSDPMLP\)"):
        copy.deepcopy(model)
