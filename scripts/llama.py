"""A small Llama-style decoder for the demo (scripts/train.py).

Pre-norm blocks of causal self-attention with rotary position embeddings and a
SwiGLU MLP, RMSNorm everywhere, and an output head that is either its own
matrix or the token embedding (``tie_embeddings``). Attention is
``F.scaled_dot_product_attention``.

Built to be constructed on the meta device and sharded before it holds any
memory, so it separates what ``to_empty`` leaves uninitialised:

- parameters: ``init_weights(model, seed)`` draws each one at full size from
  one seeded generator and keeps this rank's shard, so the initial model does
  not depend on the world size;
- non-persistent buffers (the rotary cos/sin tables): in no state dict, so no
  checkpoint restores them; ``init_weights`` recomputes them through each
  module's ``init_buffers()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention; None: n_heads (one K/V per head)
    ffn_dim: int | None = None  # None: about 8/3 * dim, rounded up to a multiple of 32
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} must be divisible by n_heads {self.n_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"head dim {self.dim // self.n_heads} (dim / n_heads) must be even for rotary "
                "embeddings; change dim or n_heads."
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.kv_heads} "
                "(each K/V head serves n_heads / n_kv_heads query heads)"
            )

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return 32 * math.ceil(8 * self.dim / 3 / 32)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # the mean of squares in fp32 even under bf16 compute
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """Rotates pairs of channels (i, i + head_dim/2) by position-dependent angles.

    The cos/sin tables are buffers with ``persistent=False``: derived from the
    config, so they stay out of state dicts and checkpoints, which is also why
    ``init_buffers()`` must run again after ``to_empty``.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.theta = theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        if self.cos.is_meta:
            return  # nothing to fill yet: called again after to_empty
        device = self.cos.device
        exponent = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
        inv_freq = 1.0 / (self.theta ** (exponent / self.head_dim))  # (head_dim/2,)
        positions = torch.arange(self.max_seq_len, device=device, dtype=torch.float32)
        angles = torch.outer(positions, inv_freq)  # (max_seq_len, head_dim/2)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (batch, heads, seq, head_dim); rotated in fp32, returned in x's dtype
        seq = x.shape[-2]
        cos, sin = self.cos[:seq], self.sin[:seq]
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        kv_dim = config.kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (batch, seq, n*hd) -> (batch, n, seq, hd)
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q = self.rotary(heads(self.wq(x)))
        k = self.rotary(heads(self.wk(x)))
        v = heads(self.wv(x))
        if self.kv_heads != self.n_heads:  # grouped-query: each K/V head to its query heads
            k = k.repeat_interleave(self.n_heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # One Parameter under two names. Both modules belong to the root's
            # group, so sharding keeps them tied.
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: (batch, seq) int64 -> logits (batch, seq, vocab)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    @torch.no_grad()
    def generate(
        self,
        prompt: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continues ``prompt`` (batch, seq) by ``max_new_tokens`` tokens.

        Calls ``self.forward`` rather than ``self(...)``: on a sharded model,
        ``register_fsdp_forward_method(model, "generate")`` already unsharded
        the root around this whole method, and calling the module would run
        its hooks a second time. Sampling is on the CPU with ``generator``
        (greedy if ``temperature`` is 0), so ranks that pass equally seeded
        generators pick the same tokens. Always runs ``max_new_tokens``
        forwards: every rank must issue the same collectives.

        Args:
            prompt: token ids, (batch, seq).
            max_new_tokens: how many tokens to append.
            temperature: divides the logits; 0 picks the argmax. (Default: 1.0)
            top_k: sample among the k most likely tokens only. (Default: None, all)
            generator: a CPU generator for sampling. (Default: None, the global one)
        """
        tokens = prompt
        for _ in range(max_new_tokens):
            context = tokens[:, -self.config.max_seq_len :]
            logits = self.forward(context)[:, -1, :].float().cpu()  # (batch, vocab)
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                next_token = torch.multinomial(probs, 1, generator=generator)
            tokens = torch.cat((tokens, next_token.to(tokens.device)), dim=1)
        return tokens


def _init_std(name: str, config: LlamaConfig) -> float | None:
    """Standard deviation of a parameter's normal init, None for norm weights (ones)."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("wo.weight", "w2.weight")):
        # Projections back into the residual stream: scaled down with depth.
        return 0.02 / math.sqrt(2 * config.n_layers)
    return 0.02


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> None:
    """Initialises every parameter and non-persistent buffer of ``model`` in place.

    Each parameter is drawn at full size on the CPU from one generator seeded
    with ``seed``, in ``named_parameters()`` order, then (for a sharded
    parameter) only this rank's ``Shard(0)`` slice is kept, with no
    communication. The initial weights are therefore the same at every world
    size, and the same as an unsharded model's. Memory: one full parameter at a
    time on the CPU.

    Args:
        model: a ``Llama``, plain or sharded, on a real device (after ``to_empty``).
        seed: seeds the generator.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():  # a tied weight appears once
        full = torch.empty(param.shape, dtype=torch.float32)
        std = _init_std(name, model.config)
        if std is None:
            full.fill_(1.0)
        else:
            full.normal_(0.0, std, generator=generator)
        if isinstance(param, DTensor):
            local = distribute_tensor(
                full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
            )
            param.copy_(local)
        else:
            param.copy_(full)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
