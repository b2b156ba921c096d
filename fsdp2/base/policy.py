"""User-facing policies passed to ``fully_shard``: mixed precision, offload and
compression (whose wire formats are in comm/wire.py), torch's FSDP2 policies
converted to fsdp2's, and how every boolean argument is read (``check_bool``)."""

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np  # torch has imported it already
import torch

from .torch_fsdp import TORCH_FSDP


# Boolean arguments, read as torch's fully_shard reads them, minus its traps.
#
# torch tests its flags for truth, so it gives a meaning to ``0``/``1`` and
# other numbers (numpy's too), numpy's booleans and ``None`` (False): fsdp2
# takes those too, with that meaning (docs/usage.md, "Arguments torch
# accepts"). It refuses a string or bytes, because ``"false"`` is true and
# would silently turn an option on, and any other object. Every
# boolean keyword of ``fully_shard``, of its policies and of ``FSDPModule``'s
# setters goes through ``check_bool``, and the code uses the bool it returns.
def check_bool(
    where: str, name: str, value: object, hint: str = "", *, strict: bool = False
) -> bool:
    """``value`` as a bool where torch reads it as one (a bool, a number,
    ``None``; with ``strict``, where torch too takes only a bool, a bool);
    otherwise a TypeError naming ``where`` (the function or class) and
    ``name`` (the argument), ending with ``hint``."""
    if isinstance(value, bool):
        return value
    if not strict and (value is None or isinstance(value, numbers.Real | np.bool_)):
        return bool(value)
    raise TypeError(
        f"{where}({name}=...) takes True or False, got {type(value).__name__} {value!r}. "
        f"Pass {name}=True or {name}=False; convert a config value first "
        f"(bool('false') is True).{hint}"
    )


def check_bools(where: str, **values: object) -> tuple[bool, ...]:
    """The boolean arguments ``values`` of ``where`` (a setter), in order, as bools."""
    return tuple(check_bool(where, name, value) for name, value in values.items())


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication; sharded parameters and optimizer
    state keep their original dtype.

    Args:
        param_dtype: dtype of the all-gather and of the unsharded parameters
            the module computes with. (Default: None, the original dtype)
        reduce_dtype: dtype of the gradient reduce-scatter (and of gradients
            accumulated without sync). Reduced gradients are cast back to the
            sharded parameter's dtype. (Default: None, ``param_dtype``)
        output_dtype: cast floating-point forward outputs to this dtype.
            (Default: None, no cast)
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype``. (Default: True)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_dtype(name, getattr(self, name))
        cast = check_bool("MixedPrecisionPolicy", "cast_forward_inputs", self.cast_forward_inputs)
        object.__setattr__(self, "cast_forward_inputs", cast)  # frozen: torch's meaning, a bool


# Spellings of dtypes seen in configs, for the hint of a string given as a dtype.
_DTYPE_SPELLINGS = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}


def _check_dtype(name: str, value: object) -> None:
    """A dtype field of ``MixedPrecisionPolicy`` is a floating-point
    ``torch.dtype`` or None; a string (a config's ``"bf16"``) would only fail
    at the first forward, deep in a cast."""
    if value is None or (isinstance(value, torch.dtype) and value.is_floating_point):
        return
    where = f"MixedPrecisionPolicy({name}=...)"
    if isinstance(value, torch.dtype):
        raise ValueError(
            f"{where} takes a floating-point dtype, got {value}: parameters and gradients "
            "are cast to it. Use torch.bfloat16, torch.float16 or torch.float32."
        )
    spelled = _DTYPE_SPELLINGS.get(str(value).lower().removeprefix("torch."))
    hint = f"use torch.{spelled}" if spelled else "use a torch.dtype such as torch.bfloat16"
    raise TypeError(
        f"{where} takes a torch.dtype or None, got {type(value).__name__} {value!r}: {hint}."
    )


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters, gradients and optimizer state live on
    the mesh's device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, gradients (and so optimizer state) live on the CPU.

    Each unshard copies the shard to the device before the all-gather, and
    each reduced gradient is copied back to the CPU; the optimizer steps on the
    CPU. On a CPU mesh this changes nothing.

    Args:
        pin_memory: pin the CPU shards so host-to-device copies can run
            asynchronously. (Default: True)
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        pin = check_bool("CPUOffloadPolicy", "pin_memory", self.pin_memory)
        object.__setattr__(self, "pin_memory", pin)  # frozen: torch's meaning, a bool


if TYPE_CHECKING:
    # torch's FSDP2 policies are accepted where fsdp2's are (converted by
    # from_torch_policy), so type checkers accept them too; imported for them only.
    import torch.distributed.fsdp as torch_fsdp

    MixedPrecisionArg: TypeAlias = MixedPrecisionPolicy | torch_fsdp.MixedPrecisionPolicy
    # None: no offload, as torch's fully_shard reads it.
    OffloadArg: TypeAlias = OffloadPolicy | torch_fsdp.OffloadPolicy | None
else:  # at run time fsdp2 never imports torch's FSDP: the types they become
    MixedPrecisionArg = MixedPrecisionPolicy
    OffloadArg = OffloadPolicy


# torch.distributed.fsdp's policies with the same meaning as fsdp2's, recognised by
# the name and module of their class: fsdp2 never imports torch's FSDP.
_TORCH_POLICIES = ("MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy")


def from_torch_policy(policy: object) -> object:
    """``policy`` as fsdp2's own when it is one of torch's FSDP2 policies
    (``torch.distributed.fsdp.MixedPrecisionPolicy``, ``CPUOffloadPolicy`` or
    ``OffloadPolicy``, or a subclass), field for field; anything else as it
    is, for the caller to check."""
    name = next(
        (
            cls.__name__
            for cls in type(policy).__mro__
            if cls.__module__.startswith(TORCH_FSDP) and cls.__name__ in _TORCH_POLICIES
        ),
        None,
    )
    fields: Any = policy  # torch's, read by field name
    if name == "MixedPrecisionPolicy":
        return MixedPrecisionPolicy(
            param_dtype=fields.param_dtype,
            reduce_dtype=fields.reduce_dtype,
            output_dtype=fields.output_dtype,
            cast_forward_inputs=fields.cast_forward_inputs,
        )
    if name == "CPUOffloadPolicy":
        return CPUOffloadPolicy(pin_memory=fields.pin_memory)
    if name == "OffloadPolicy":
        return OffloadPolicy()
    return policy


def full_type_name(value: object) -> str:
    """``value``'s class as module and name, e.g. ``torch.distributed.fsdp.MixedPrecision``."""
    cls = type(value)
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


WEIGHT_SETTINGS = (None, "int8")
GRADIENT_SETTINGS = (None, "bf16", "int8")
ACROSS_SETTINGS = ("all", "replicate")


@dataclass(frozen=True)
class CompressionPolicy:
    """What ``fully_shard`` compresses on the wire (see docs/usage.md).

    Args:
        weights: ``"int8"``: each rank's shard is quantized blockwise and
            all-gathered as bytes, dequantized into ``param_dtype`` at the
            copy-out; the sharded parameters stay as they are. (Default: None)
        gradients: ``"bf16"`` or ``"int8"``: the reduce-scatter becomes an
            all-to-all of the compressed rows of its input, summed in fp32 by
            the receiving rank, then averaged as before. (Default: None)
        block_size: values per int8 block (one fp32 scale each). (Default: 256)
        across: ``"all"`` compresses every collective named above;
            ``"replicate"`` only those across HSDP replicas (the slow link):
            the gradients' all-reduce there, or with
            ``shard_optimizer_over_replicas`` the reduce-scatter and the
            weights' all-gather across them. (Default: "all")
    """

    weights: str | None = None
    gradients: str | None = None
    block_size: int = 256
    across: str = "all"

    def __post_init__(self) -> None:
        _check_choice("weights", self.weights, WEIGHT_SETTINGS)
        _check_choice("gradients", self.gradients, GRADIENT_SETTINGS)
        _check_choice("across", self.across, ACROSS_SETTINGS)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(
                "CompressionPolicy(block_size=...) expects an int, got "
                f"{type(self.block_size).__name__}. Pass e.g. block_size=256."
            )
        if self.block_size < 1:
            raise ValueError(
                f"CompressionPolicy(block_size=...) must be at least 1, got {self.block_size}. "
                "Pass e.g. block_size=256 (one fp32 scale per 256 values)."
            )

    @property
    def enabled(self) -> bool:
        return self.weights is not None or self.gradients is not None


def _check_choice(field: str, value: object, choices: tuple[str | None, ...]) -> None:
    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"CompressionPolicy({field}=...) expects one of {choices}, got "
            f"{type(value).__name__} {value!r}."
        )
    if value not in choices:
        raise ValueError(
            f"CompressionPolicy({field}=...) must be one of {choices}, got {value!r}. "
            f"Pass e.g. {field}={choices[-1]!r}."
        )
