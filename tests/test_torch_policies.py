"""torch.distributed.fsdp's own policies passed to ``fsdp2.fully_shard``: each
is converted to fsdp2's policy with the same fields; anything else is refused
by a message that names its full type.

Single process: a "fake" process group of world size 4 builds the mesh.
"""

import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn
from dist import fake_world
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp2
from fsdp2.base.policy import from_torch_policy

DTYPES = [None, torch.bfloat16, torch.float32]


@pytest.mark.parametrize(
    ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs"),
    list(itertools.product(DTYPES, DTYPES, [None, torch.float16], [True, False])),
)
def test_torch_mixed_precision_policy_converts_field_for_field(
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    output_dtype: torch.dtype | None,
    cast_forward_inputs: bool,
) -> None:
    fields = {
        "param_dtype": param_dtype,
        "reduce_dtype": reduce_dtype,
        "output_dtype": output_dtype,
        "cast_forward_inputs": cast_forward_inputs,
    }
    converted = from_torch_policy(torch_fsdp.MixedPrecisionPolicy(**fields))
    assert type(converted) is fsdp2.MixedPrecisionPolicy
    assert converted == fsdp2.MixedPrecisionPolicy(**fields)


@pytest.mark.parametrize("pin_memory", [True, False])
def test_torch_offload_policies_convert(pin_memory: bool) -> None:
    converted = from_torch_policy(torch_fsdp.CPUOffloadPolicy(pin_memory=pin_memory))
    assert type(converted) is fsdp2.CPUOffloadPolicy
    assert converted == fsdp2.CPUOffloadPolicy(pin_memory=pin_memory)
    assert type(from_torch_policy(torch_fsdp.OffloadPolicy())) is fsdp2.OffloadPolicy


def test_fsdp2_policies_and_other_objects_pass_through_unchanged() -> None:
    for policy in (fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16), fsdp2.OffloadPolicy()):
        assert from_torch_policy(policy) is policy
    other = object()
    assert from_torch_policy(other) is other


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    with fake_world(4):
        yield init_device_mesh("cpu", (4,))


def test_fully_shard_builds_with_torchs_policies(mesh: DeviceMesh) -> None:
    mp_policy = torch_fsdp.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    model = fsdp2.fully_shard(
        nn.Linear(8, 8),
        mesh=mesh,
        mp_policy=mp_policy,
        offload_policy=torch_fsdp.CPUOffloadPolicy(pin_memory=False),
    )
    state = model._fsdp_state
    expected = fsdp2.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    assert state.mp_policy == expected
    fsdp_param = state.param_groups[0].fsdp_params[0]
    assert fsdp_param.mp_policy == expected
    assert fsdp_param.offload and not fsdp_param.pin_memory
    assert fsdp_param.param_dtype == torch.bfloat16 and fsdp_param.reduce_dtype == torch.float32


def test_offload_policy_none_is_no_offload(mesh: DeviceMesh) -> None:
    """torch's fully_shard offloads only for a CPUOffloadPolicy, so None means
    no offload (verl's engines pass it to every call): fsdp2 reads it the same."""
    model = fsdp2.fully_shard(nn.Linear(8, 8), mesh=mesh, offload_policy=None)
    assert not model._fsdp_state.param_groups[0].fsdp_params[0].offload


class MixedPrecisionPolicy:
    """A user's class named like torch's policy: outside torch.distributed.fsdp,
    so not converted."""


def test_wrong_policy_type_names_its_full_type(mesh: DeviceMesh) -> None:
    with pytest.raises(
        TypeError,
        match=r"mp_policy must be an fsdp2\.MixedPrecisionPolicy \(or torch\.distributed\.fsdp's "
        r"MixedPrecisionPolicy\), got torch\.distributed\.fsdp\.api\.MixedPrecision\. Pass e\.g\.",
    ):
        fsdp2.fully_shard(
            nn.Linear(8, 8),
            mesh=mesh,
            mp_policy=torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16),  # type: ignore[arg-type]
        )
    with pytest.raises(
        TypeError, match=r"got test_torch_policies\.MixedPrecisionPolicy\. Pass e\.g\. mp_policy="
    ):
        fsdp2.fully_shard(nn.Linear(8, 8), mesh=mesh, mp_policy=MixedPrecisionPolicy())  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"offload_policy must be fsdp2\.OffloadPolicy\(\) or fsdp2\.CPUOffloadPolicy\(\) "
        r"\(or torch\.distributed\.fsdp's\), got torch\.distributed\.fsdp\.api\.CPUOffload\.",
    ):
        fsdp2.fully_shard(
            nn.Linear(8, 8),
            mesh=mesh,
            offload_policy=torch_fsdp.CPUOffload(offload_params=True),  # type: ignore[arg-type]
        )
    with pytest.raises(TypeError, match=r"got dict\. Pass e\.g\. offload_policy="):
        fsdp2.fully_shard(nn.Linear(8, 8), mesh=mesh, offload_policy={})  # type: ignore[arg-type]
