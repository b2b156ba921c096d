"""``fsdp2.optim.Muon``: ``torch.optim.Muon`` on fsdp2's sharded parameters.

The elementwise work (momentum, weight decay, the update) runs on each rank's
local shard; only Newton-Schulz needs whole matrices, and each matrix's owner
runs it once (``exchange.py``). On plain tensors it runs locally as torch does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import ParamsT

from ..base.private_dist import local_tensor
from .exchange import NewtonSchulzArgs, ShardGroup, orthogonalize_row_blocks, shard_group_of
from .newton_schulz import ADJUST_LR_FNS, adjusted_lr, orthogonalize

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
DEFAULT_EPS = 1e-7
DEFAULT_NS_STEPS = 5
MAX_NS_STEPS = 99

RECIPE = (
    "Muon is for the 2-D weight matrices of the hidden layers; give embeddings, norms, "
    "biases and the output head to torch.optim.AdamW in a second optimizer (see "
    "docs/usage.md, 'Muon')."
)


class Muon(torch.optim.Optimizer):
    """Muon with ``torch.optim.Muon``'s arguments and arithmetic, on DTensors
    sharded by fsdp2 (dim 0, FSDP or HSDP) and on plain tensors.

    After a step, each parameter's ``full_tensor()`` is bitwise what
    ``torch.optim.Muon`` computes on the unsharded parameter and gradient.

    Args:
        params: 2-D parameters, or param groups of them.
        lr: learning rate. (Default: 1e-3)
        weight_decay: decoupled weight decay. (Default: 0.1)
        momentum: momentum factor. (Default: 0.95)
        nesterov: use Nesterov momentum. (Default: True)
        ns_coefficients: the (a, b, c) of the quintic Newton-Schulz iteration.
            (Default: (3.4445, -4.7750, 2.0315))
        eps: floor of the norm the update is divided by. (Default: 1e-7)
        ns_steps: Newton-Schulz iterations, at most 99. (Default: 5)
        adjust_lr_fn: None or "original" (``sqrt(max(1, rows / cols))``), or
            "match_rms_adamw" (``0.2 * sqrt(max(rows, cols))``). (Default: None)
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | torch.Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
    ) -> None:
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"a Tensor lr must have one element, got shape {tuple(lr.shape)}")
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"momentum must be >= 0, got {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        for options in self.param_groups:
            _check_ns_args(options)
            for param in options["params"]:
                if param.ndim != 2:
                    raise ValueError(
                        f"fsdp2.optim.Muon only optimizes 2-D parameters, got one of shape "
                        f"{tuple(param.shape)}. {RECIPE}"
                    )
                if isinstance(param, DTensor):
                    shard_group_of(param, f"a parameter of shape {tuple(param.shape)}")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step; on sharded parameters, a collective over each shard group."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Updates of sharded matrices wait here, per shard group, for one exchange.
        pending: dict[ShardGroup, list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]] = {}
        for options in self.param_groups:
            for param in options["params"]:
                if param.grad is None:
                    continue
                update = self._momentum_update(param, param.grad, options)
                if isinstance(param, DTensor):
                    pending.setdefault(shard_group_of(param), []).append((param, update, options))
                else:
                    _apply(param, orthogonalize(update, *_ns_args(options)), options)
        for shard_group, entries in pending.items():
            results = orthogonalize_row_blocks(
                [update for _, update, _ in entries],
                [param.shape for param, _, _ in entries],
                [_ns_args(options) for _, _, options in entries],
                shard_group,
            )
            for (param, _, options), result in zip(entries, results, strict=True):
                _apply(param, result, options)
        return loss

    def _momentum_update(
        self, param: torch.Tensor, grad: torch.Tensor, options: dict[str, Any]
    ) -> torch.Tensor:
        """Updates the momentum buffer; returns this rank's part of the update to orthogonalize."""
        if torch.is_complex(param):
            raise RuntimeError("fsdp2.optim.Muon does not support complex parameters")
        if grad.is_sparse:
            raise RuntimeError("fsdp2.optim.Muon does not support sparse gradients")
        state = self.state[param]
        if "momentum_buffer" not in state:
            # A DTensor shaped and placed like the parameter: resharding checkpoints works.
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buf, momentum = state["momentum_buffer"], options["momentum"]
        if isinstance(grad, DTensor):
            grad, buf = local_tensor(grad), local_tensor(buf)
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if options["nesterov"] else buf


def _check_ns_args(options: dict[str, Any]) -> None:
    if options["ns_steps"] > MAX_NS_STEPS:
        raise ValueError(f"ns_steps must be at most {MAX_NS_STEPS}, got {options['ns_steps']}")
    if len(options["ns_coefficients"]) != 3:
        raise ValueError(
            f"ns_coefficients must be 3 values (a, b, c), got {options['ns_coefficients']}"
        )


def _ns_args(options: dict[str, Any]) -> NewtonSchulzArgs:
    return NewtonSchulzArgs(tuple(options["ns_coefficients"]), options["ns_steps"], options["eps"])


def _apply(param: torch.Tensor, orthogonal: torch.Tensor, options: dict[str, Any]) -> None:
    """Weight decay, then the orthogonalized update, on this rank's rows of ``param``."""
    lr = options["lr"]
    lr = lr.item() if isinstance(lr, torch.Tensor) else lr
    step_size = adjusted_lr(lr, options["adjust_lr_fn"], param.shape)
    local = local_tensor(param) if isinstance(param, DTensor) else param
    local.mul_(1 - lr * options["weight_decay"])
    local.add_(orthogonal, alpha=-step_size)
