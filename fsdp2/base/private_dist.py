"""The private names of torch.distributed that fsdp2 relies on: DTensor's
insides, DeviceMesh slices, c10d's timeouts and process groups, the
composable-API registry. private_api.py holds the rest (autograd, compile,
the profiler, pytree, foreach kernels, module internals); the two files are
the only places fsdp2 reaches into torch.

Each wrapper says why no public API does the job; when torch grows a public
equivalent, only this file changes.
"""

import contextlib
import functools
import logging
import operator
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import _disable_current_modes

_T = TypeVar("_T")


def premul_sum(factor: float) -> dist.ReduceOp:
    """NCCL's ``PREMUL_SUM`` reduction, multiplying each input by ``factor``.

    Why private: torch 2.13 makes it public (``ReduceOp.PREMUL_SUM(factor)``);
    before that (a GPU machine may carry torch 2.11) only
    ``_make_nccl_premul_sum`` builds it.
    """
    op = dist.ReduceOp.PREMUL_SUM
    if callable(op):
        return op(factor)
    return dist._make_nccl_premul_sum(factor)  # type: ignore[attr-defined]


def mark_composable_api(module: torch.nn.Module, api_name: str) -> None:
    """Records that ``api_name`` (``"fully_shard"``) manages ``module``, where
    torch's other composable APIs look for it.

    Why private: ``replicate`` (composable DDP) leaves out the parameters of
    modules that ``fully_shard`` manages only if it finds that name in the
    module's composable-API registry; without it, ``replicate(model)`` over a
    model with sharded blocks would all-reduce their shards' gradients across
    ranks, adding different shards together. The registry has no public API.
    """
    registry = module.__dict__.setdefault(REGISTRY_KEY, {})
    registry.setdefault(api_name, RegistryItem())


def local_tensor(dtensor: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of ``dtensor`` itself (not a view of it).

    Why private: ``DTensor.to_local()`` is an autograd Function, which costs a
    graph node per call on the hot path (every parameter, every unshard) and
    refuses to run inside functorch transforms; the engine only reads or
    writes the data in place, outside autograd, as torch's own fully_shard does.
    """
    if not isinstance(dtensor, DTensor):
        raise AssertionError(f"expected a DTensor, got a {type(dtensor).__name__}")
    return dtensor._local_tensor


def set_local_tensor(dtensor: torch.Tensor, local: torch.Tensor) -> None:
    """Makes ``dtensor`` hold ``local`` (same shape, dtype and strides) instead
    of its tensor, keeping the object.

    Why private: a DTensor has no public way to change the tensor it wraps,
    and a new DTensor would be a new object: an optimizer already built on the
    parameter would step the old one (CPU offload pins a shard again in place).
    """
    if not isinstance(dtensor, DTensor):
        raise AssertionError(f"expected a DTensor, got a {type(dtensor).__name__}")
    dtensor._local_tensor = local


def dtensor_spec(
    mesh: DeviceMesh, placements: tuple[Placement, ...], size: torch.Size, dtype: torch.dtype
) -> DTensorSpec:
    """The (immutable) layout description of a contiguous DTensor, built once per parameter."""
    stride = torch.empty(size, device="meta").stride()
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(size, stride, dtype))


def dtensor_from_local_no_grad(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """Wraps ``local`` as a DTensor with a prebuilt spec, outside autograd.

    Why private: ``DTensor.from_local`` goes through an autograd Function and
    rebuilds the spec on every call; for the gradients of every parameter of
    every step that was a large share of the hooks' host time. The DTensor
    constructor with a cached spec is what torch's own fully_shard uses.
    """
    return DTensor(local, spec, requires_grad=False)


def dtensor_spec_of(dtensor: DTensor) -> DTensorSpec:
    """The layout description ``dtensor`` holds (to wrap another local tensor laid out alike)."""
    return dtensor._spec


def step_local_tensors(lists: tuple[list[Any], ...]) -> bool:
    """Replaces, in place, each DTensor in ``lists`` by its local tensor where
    that is exact for elementwise math: all or nothing (returns whether done).

    ``lists[0]`` are the parameters; every other list has one entry per
    parameter (a row) or none (Adam's ``max_exp_avg_sqs`` without amsgrad).
    In a row whose parameter is a DTensor, each other DTensor must share its
    mesh and placements and each plain tensor be a scalar (a step count); a
    row whose parameter is plain is left as it is.

    Why private: ``to_local()`` is an autograd Function, microseconds per call,
    several per parameter per step; the spec is read without copies.
    """
    params = lists[0]
    specs = [p._spec if type(p) is DTensor else None for p in params]
    locals_: list[list[Any]] = []
    for tensors in lists:
        if not tensors:
            locals_.append(tensors)
            continue
        if len(tensors) != len(specs):
            return False
        local: list[Any] = []
        for tensor, spec in zip(tensors, specs, strict=True):
            if spec is None or tensor is None:
                local.append(tensor)
            elif type(tensor) is DTensor:
                own = tensor._spec
                if own.placements != spec.placements or (
                    own.mesh is not spec.mesh and own.mesh != spec.mesh
                ):
                    return False
                local.append(tensor._local_tensor)
            elif tensor.ndim == 0:
                local.append(tensor)
            else:
                return False
        locals_.append(local)
    for tensors, local in zip(lists, locals_, strict=True):
        tensors[:] = local
    return True


_SPEC = operator.attrgetter("_spec")


_LOCAL = operator.attrgetter("_local_tensor")


def dtensor_specs(tensors: list[Any]) -> list[DTensorSpec] | None:
    """The spec of each of ``tensors``, or None if one is not a DTensor.

    Why private: as ``step_local_tensors``, at C speed (one ``map``): an
    optimizer step checks every gradient and state this way.
    """
    try:
        return list(map(_SPEC, tensors))
    except AttributeError:
        return None


def locals_in_place(dtensors: list[Any]) -> None:
    """Puts each of ``dtensors`` by its local tensor (why private: as above)."""
    dtensors[:] = map(_LOCAL, dtensors)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """The mesh whose axes are those of ``meshes`` in order, all slices of one
    root mesh (e.g. ``mesh["dp"]`` and ``mesh["tp"]``), reusing their process
    groups; a ValueError if they are not orthogonal slices of one root mesh.

    Why private: a sharded TP parameter lives on the axes of both slices, and
    there is no public way to join slices of a mesh. Building a new
    ``DeviceMesh`` from ranks would create new process groups on every call (a
    collective).
    """
    try:
        return DeviceMesh._concatenate(meshes)
    except (RuntimeError, TypeError, AttributeError) as error:
        raise ValueError(
            f"the meshes {meshes} must be named slices of one mesh ({error})"
        ) from error


def flatten_axes(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """One axis over the ranks of several axes of ``mesh`` (``dp_mesh_dims`` that
    names several axes to shard or replicate over).

    Why private: ``DeviceMesh._flatten`` is the only way to get such an axis
    with its process group cached on the root mesh; torch's fully_shard uses it.
    """
    return mesh[names]._flatten("_".join(names))


def strided_shard(dim: int, split_factor: int) -> Placement:
    """The data-parallel placement of a dim that tensor parallelism shards too:
    each rank holds a chunk of a TP chunk, not a chunk of the whole dim.

    Why private: ``_StridedShard`` is the only placement DTensor has for that
    layout; without it ``full_tensor()`` and checkpoints would put rows in the
    wrong order. torch's own FSDP+TP uses it.
    """
    return _StridedShard(dim, split_factor=split_factor)


def shards_tensor(placement: Placement) -> bool:
    """Whether ``placement`` cuts the tensor across the axis (``Shard`` or the
    ``_StridedShard`` of FSDP over TP), as opposed to replicating it or
    holding partial sums.

    Why private: ``_StridedShard`` is not a ``Shard`` subclass, and its
    ``is_shard()`` answers False.
    """
    return isinstance(placement, Shard | _StridedShard)


def is_strided_shard(placement: object) -> bool:
    """Whether ``placement`` is a ``_StridedShard`` (see ``strided_shard``).

    Why private: the class is private.
    """
    return isinstance(placement, _StridedShard)


def redistribute_logger() -> logging.Logger:
    """The logger of DTensor's redistribution, whose notices name each step it
    could not merge into one collective (``(src placements, dst placements,
    count, collective, reason)`` as the record's arguments).

    Why private: the notice is logged, not warned, by a private module; no
    public switch turns it off.
    """
    return logging.getLogger("torch.distributed.tensor._redistribute")


@contextlib.contextmanager
def unseen_by_dispatch_modes() -> Iterator[None]:
    """Runs a safety check's own small collective (the same-model, unsharded
    and execution-order checks) with this thread's dispatch modes popped, so
    that ``CommDebugMode``, a user's op logger or a test's counter see the
    collectives of training alone, as torch's fully_shard issues them; the
    check still communicates (docs/design.md, "What the checks cost").

    Why private: dispatch modes have no public "hide these ops" switch
    (``_disable_current_modes``).
    """
    with _disable_current_modes():
        yield


def run_as_collective(
    implementation: Callable[[], _T],
    collective: Literal["all_gather", "reduce_scatter"],
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
) -> _T:
    """Runs ``implementation`` (fsdp2's collective built from other ones, see
    [Note: collectives on gloo] in primitives.py) so that this rank's dispatch
    modes (``CommDebugMode``, the tests' stream model, a user's op logger) see
    the one c10d collective it implements, with its output and input, as
    torch's own collective would show them, instead of its broadcasts or sends.

    The collective is first dispatched on a stand-in group of torch's fake
    backend, which exchanges nothing, then the parts run with the modes popped
    (``unseen_by_dispatch_modes``) and write the real result: the messages
    between the ranks do not depend on which rank has modes.

    Why private: dispatch modes have no public "hide these ops" switch
    (``_disable_current_modes``), and a group that dispatches collectives
    without moving data is built from c10d's backend registration and fake
    backend (``_register_backend``, ``FakeProcessGroup``).
    """
    if torch._C._len_torch_dispatch_stack() == 0:
        return implementation()
    stand_in = _stand_in_group(group.rank(), group.size())
    if collective == "all_gather":
        stand_in._allgather_base(output, input)
    else:
        options = dist.ReduceScatterOptions()
        options.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
        stand_in._reduce_scatter_base(output, input, options)
    with unseen_by_dispatch_modes():
        return implementation()


@functools.cache
def _stand_in_group(rank: int, world_size: int) -> dist.ProcessGroup:
    from torch._C._distributed_c10d import FakeProcessGroup

    group = dist.ProcessGroup(dist.HashStore(), rank, world_size)
    backend_type = dist.ProcessGroup.BackendType.CUSTOM
    group._set_default_backend(backend_type)
    group._register_backend(
        torch.device("cpu"), backend_type, FakeProcessGroup._create_internal(rank, world_size)
    )
    return group


def group_timeout(group: dist.ProcessGroup, device_type: str) -> timedelta | None:
    """How long ``group``'s collectives on ``device_type`` wait for a peer, or
    None if its backend does not say (a fake or third-party group).

    Why private: no public API reads a group's timeout; its backend's options
    hold it (gloo's and NCCL's alike).
    """
    try:
        return group._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def backend_default_timeout(backend: str) -> timedelta:
    """The timeout a group of ``backend`` ("gloo", "nccl") gets when it is
    created without one (30 min for gloo, 10 for NCCL in torch 2.13).

    Why private: ``new_group`` and ``init_device_mesh`` fill it in from
    ``_get_default_timeout``, which tells it per backend; the public constants
    would repeat torch's rule here.
    """
    return dist.distributed_c10d._get_default_timeout(dist.Backend(backend))


def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """Makes ``group``'s collectives from now on fail after ``timeout`` (gloo:
    the wait raises; NCCL: its watchdog aborts the group).

    Why private: ``_set_pg_timeout`` is torch's documented way to change a
    live group's timeout, backend by backend (gloo, NCCL); the public-looking
    ``ProcessGroup.set_timeout`` has no documentation saying what it reaches.
    """
    dist.distributed_c10d._set_pg_timeout(timeout, group)
