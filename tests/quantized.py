"""A small tensor subclass that all-gathers itself, for the extension tests.

``RowQuantized`` holds a 2D weight as int8 rows and one float32 scale per row
(``value[i] = qdata[i] * scale[i]``). Like torchao's int8 quantized-training
weight it all-gathers its two inner tensors (two dtypes) instead of itself, so
it exercises torch's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
contract. Row quantization does not depend on which rows a rank holds, so a
sharded model and an unsharded one quantize to the same values: training
parity with the reference stays exact up to summation order.

Every op other than the few that sharding needs runs on the dequantized
value and returns a plain tensor (gradients are plain tensors); an in-place
op (the optimizer's) is applied to the dequantized value and quantized back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

aten = torch.ops.aten


class RowQuantized(torch.Tensor):
    # (out is None, out) of every fsdp_post_all_gather call, in order, this process.
    post_all_gather_calls: list[tuple[bool, torch.Tensor | None]] = []

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=scale.dtype, device=qdata.device, requires_grad=requires_grad
        )

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, requires_grad: bool = False):
        self.qdata = qdata  # int8, (rows, cols)
        self.scale = scale  # float32, (rows,)

    def __repr__(self) -> str:
        return f"RowQuantized(shape={tuple(self.shape)})"

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return RowQuantized(inner["qdata"], inner["scale"])

    @classmethod
    def quantize(cls, value: torch.Tensor) -> RowQuantized:
        scale = value.detach().abs().amax(dim=1).clamp(min=1e-8) / 127
        qdata = (value.detach() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        return cls(qdata, scale.to(torch.float32))

    def dequantize(self) -> torch.Tensor:
        return self.qdata.to(self.scale.dtype) * self.scale[:, None]

    # -- the FSDP all-gather protocol -------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self.qdata, self.scale), {"rows": self.qdata.size(0)}

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        qdata, scale = all_gather_outputs
        assert qdata.dtype == torch.int8 and scale.dtype == torch.float32, (qdata, scale)
        assert qdata.size(0) == scale.size(0) and metadata["rows"] <= qdata.size(0)
        RowQuantized.post_all_gather_calls.append((out is None, out))
        if out is not None:
            # Refilled in place: out's inner tensors are the outputs' storage.
            assert out.qdata.untyped_storage().data_ptr() == qdata.untyped_storage().data_ptr()
            assert out.scale.untyped_storage().data_ptr() == scale.untyped_storage().data_ptr()
            return None
        return RowQuantized(qdata, scale), (qdata, scale)

    # -- dispatch -----------------------------------------------------------

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SHARDING_OPS:
            return _SHARDING_OPS[func](*args, **kwargs)

        def plain(x: Any) -> Any:
            return x.dequantize() if isinstance(x, RowQuantized) else x

        plain_args, plain_kwargs = pytree.tree_map(plain, (args, kwargs))
        if func._schema.is_mutable and isinstance(args[0], RowQuantized):
            func(*plain_args, **plain_kwargs)  # in place on the dequantized value
            args[0]._assign(plain_args[0])
            return args[0]
        return func(*plain_args, **plain_kwargs)

    def _assign(self, value: torch.Tensor) -> None:
        new = RowQuantized.quantize(value)
        self.qdata.copy_(new.qdata)
        self.scale.copy_(new.scale)


def _split(t: RowQuantized, split_size, dim: int = 0):
    assert dim == 0, "RowQuantized splits by rows only"
    return [
        RowQuantized(q, s)
        for q, s in zip(t.qdata.split(split_size), t.scale.split(split_size), strict=True)
    ]


def _split_with_sizes(t: RowQuantized, sizes, dim: int = 0):
    assert dim == 0, "RowQuantized splits by rows only"
    return [
        RowQuantized(q, s) for q, s in zip(t.qdata.split(sizes), t.scale.split(sizes), strict=True)
    ]


def _slice(t: RowQuantized, dim: int = 0, start=None, end=None, step: int = 1):
    assert dim == 0, "RowQuantized slices by rows only"
    return RowQuantized(t.qdata[start:end:step], t.scale[start:end:step])


def _new_zeros(t: RowQuantized, size, **kwargs):
    return RowQuantized(t.qdata.new_zeros(size), t.scale.new_zeros(size[0]))


def _copy_(dst: RowQuantized, src: torch.Tensor, non_blocking: bool = False):
    if isinstance(src, RowQuantized):
        dst.qdata.copy_(src.qdata)
        dst.scale.copy_(src.scale)
    else:
        dst._assign(src)
    return dst


def _alias(t: RowQuantized, *args, **kwargs):
    return RowQuantized(t.qdata, t.scale)


def _view(t: RowQuantized, size):
    assert tuple(size) == tuple(t.shape), f"RowQuantized views as itself only, not {size}"
    return RowQuantized(t.qdata, t.scale)


def _clone(t: RowQuantized, **kwargs):
    return RowQuantized(t.qdata.clone(), t.scale.clone())


def _to_copy(t: RowQuantized, dtype=None, device=None, **kwargs):
    if dtype is not None and dtype != t.dtype:
        return t.dequantize().to(dtype=dtype, device=device)
    return RowQuantized(t.qdata.to(device=device), t.scale.to(device=device))


_SHARDING_OPS = {
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split_with_sizes,
    aten.slice.Tensor: _slice,
    aten.new_zeros.default: _new_zeros,
    aten.copy_.default: _copy_,
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.view.default: _view,
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
}
