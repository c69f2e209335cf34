"""Building blocks of the decoder models: RMSNorm, rotary embedding, gated MLP, attention.

Attention keeps no KV cache of its own: the forward context's backend stores K/V in the
paged pool. Projections reading the same input are fused (``qkv_proj``, ``gate_up_proj``):
one matrix product instead of three is what makes small-batch CPU decode fast. On CPU each
projection is packed once after loading (docs/cpu-kernels.md); AWQ int4 weights load into
``AwqLinear`` (docs/awq.md).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.awq_pack import PACK, dequantize
from kernels.cpu import elementwise as cpu_elementwise
from services.worker.cpu_linear import PackedLinear
from services.worker.forward_context import ForwardContext
from services.worker.quant.awq import packed_shapes


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = _fused(x) if x.is_contiguous() else None
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)[1]
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Reduced precision: statistics in float32, the weight applied in x's dtype (as HF).
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + h, its norm) in one pass where the C kernel serves; bit-identical sum."""
        fused = _fused(x) if x.is_contiguous() and h.is_contiguous() else None
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps, h)
        total = x + h
        return total, self(total)


class Linear(nn.Linear):
    """nn.Linear that can run prepacked through oneDNN once its weights are loaded."""

    packed: PackedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight, self.bias)

    def pack(self, keep_plain: bool = False) -> bool:
        """Packs where cpu_linear says that beats F.linear; returns whether it did. Unless
        keep_plain, a oneDNN-packed weight becomes a meta tensor so memory does not double."""
        packed = PackedLinear(self.weight, self.bias, keep_plain=keep_plain)
        if not packed.path.startswith("onednn") and packed.kernel_rows <= 0:
            return False
        self.packed = packed
        if packed.path.startswith("onednn") and not keep_plain:
            self.weight = nn.Parameter(self.weight.to("meta"), requires_grad=False)
        return True


class FusedLinear(Linear):
    """A Linear whose output rows are several checkpoint tensors stacked (shard_sizes)."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)

    def shard_view(self, leaf: str, tensor: torch.Tensor, shard: int) -> torch.Tensor:
        """The rows of ``tensor`` (weight or bias) that checkpoint shard ``shard`` fills."""
        start = sum(self.shard_sizes[:shard])
        return tensor[start : start + self.shard_sizes[shard]]


class AwqLinear(nn.Module):
    """A linear (or fused linears) holding AWQ's packed int4 weights in checkpoint layout:
    ``qweight`` [in, out/8] int32, ``qzeros`` [in/group, out/8] int32, ``scales``
    [in/group, out] float16; fused shards side by side along the output columns."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: list[int],
        bias: bool,
        group_size: int,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, sum(shard_sizes)
        self.shard_sizes, self.group_size = list(shard_sizes), group_size
        self.dtype = dtype  # the compute dtype (of the bias, and of to_dense's weight)
        shapes = packed_shapes(in_features, self.out_features, group_size)
        self.qweight: torch.Tensor
        self.qzeros: torch.Tensor
        self.scales: torch.Tensor
        self.register_buffer("qweight", torch.empty(shapes["qweight"], dtype=torch.int32))
        self.register_buffer("qzeros", torch.empty(shapes["qzeros"], dtype=torch.int32))
        self.register_buffer("scales", torch.empty(shapes["scales"], dtype=torch.float16))
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype)) if bias else None

    @classmethod
    def like(cls, linear: Linear, group_size: int) -> AwqLinear:
        shards = getattr(linear, "shard_sizes", [linear.out_features])
        with torch.device(linear.weight.device):
            return cls(
                linear.in_features,
                shards,
                linear.bias is not None,
                group_size,
                linear.weight.dtype,
            )

    def shard_view(self, leaf: str, tensor: torch.Tensor, shard: int) -> torch.Tensor:
        """The columns of ``tensor`` that shard ``shard`` fills (8 per int32 when packed)."""
        start, size = sum(self.shard_sizes[:shard]), self.shard_sizes[shard]
        if leaf == "bias":
            return tensor[start : start + size]
        if leaf == "scales":
            return tensor[:, start : start + size]
        return tensor[:, start // PACK : (start + size) // PACK]

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[out, in] in ``dtype``: exact in float32, rounded once otherwise."""
        w = dequantize(self.qweight, self.qzeros, self.scales, self.group_size)  # [in, out]
        return w.t().contiguous().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            rows = x.reshape(-1, self.in_features)  # [T, in]
            y = _awq_gemm()(rows, self.qweight, self.qzeros, self.scales, self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        return F.linear(x, self.dense_weight(x.dtype), self.bias)

    def to_dense(self) -> Linear:
        weight = self.dense_weight(self.dtype)
        with torch.device("meta"):
            bias = self.bias is not None
            if len(self.shard_sizes) > 1:
                dense: Linear = FusedLinear(self.in_features, self.shard_sizes, bias)
            else:
                dense = Linear(self.in_features, self.out_features, bias=bias)
        dense.weight = nn.Parameter(weight, requires_grad=False)
        if self.bias is not None:
            dense.bias = nn.Parameter(self.bias.data, requires_grad=False)
        return dense


@functools.cache
def _awq_gemm() -> Callable[..., torch.Tensor]:
    """Imported on first use: CPU-only workers never import Triton."""
    from kernels.triton.awq_gemm import awq_gemm

    return awq_gemm


def rope_parameters(config) -> dict:
    """Rope settings from rope_parameters (transformers 5.x) or rope_scaling + rope_theta."""
    params = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default")) or "default"
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths slowed by ``factor``, a smooth ramp in between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(config, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies (on CPU; the model moves them)."""
    p = rope_parameters(config)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (float(p["rope_theta"]) ** exponents)
    kind = p["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(p["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, p)
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (the halves of head_dim rotate together)."""

    def __init__(self, config, head_dim: int):
        super().__init__()
        # Not a buffer: the model is built on the meta device and this must hold real values.
        self.inv_freq = rope_inv_freq(config, head_dim)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per forward, shared by every layer: cos, sin [T, head_dim // 2]."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


# CPU rotary, RMSNorm and silu(gate) * up run fused C passes (kernels/cpu/elementwise.py);
# False keeps torch's expressions.
FUSED_ELEMENTWISE = True


def _fused(x: torch.Tensor) -> cpu_elementwise.Elementwise | None:
    if not FUSED_ELEMENTWISE or not cpu_elementwise.supports(x):
        return None
    return cpu_elementwise.load()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos/sin: [T, D/2] broadcast over heads
    fused = _fused(x)
    if fused is not None:  # the same rounded operations: bit-identical
        return fused.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False):
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported ({sorted(_ACTIVATIONS)})")
        self.gate_up_proj = FusedLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = _ACTIVATIONS[act]
        self.intermediate = intermediate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        fused = _fused(gate_up) if self.act is F.silu else None
        if fused is not None and fused.silu_mul is not None:
            return self.down_proj(fused.silu_mul(gate_up, self.intermediate))
        gate, up = gate_up.split(self.intermediate, dim=-1)  # each [T, I]
        return self.down_proj(self.act(gate) * up)


class Attention(nn.Module):
    """Self-attention over the paged pool: qkv projection, optional q/k norm, rope, backend."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_id = layer_id
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = FusedLinear(
            hidden, [self.q_size, self.kv_size, self.kv_size], bias=qkv_bias
        )
        self.o_proj = Linear(self.q_size, hidden, bias=o_bias)
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # qkv: [T, (H + 2 KVH) * D]
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)  # v: [T, KVH, D]
        q, k = self._rotated_qk(qkv[:, :qk_size], ctx)
        out = ctx.attention(self.layer_id, q, k, v)  # out: [T, H, D]
        return self.o_proj(out.reshape(t, self.q_size))  # [T, H * D] -> [T, hidden]

    def _rotated_qk(
        self, qk: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """qk: [T, (H + KVH) * D] -> q: [T, H, D], k: [T, KVH, D], normed (Qwen3) and rotated."""
        t, heads = qk.shape[0], self.num_heads + self.num_kv_heads
        if self.q_norm is None or self.k_norm is None:
            # q and k side by side are heads too: one rotary pass for both.
            both = apply_rotary(qk.view(t, heads, self.head_dim), ctx.cos, ctx.sin)
            return both[:, : self.num_heads], both[:, self.num_heads :]
        q = self.q_norm(qk[:, : self.q_size].view(t, self.num_heads, self.head_dim))
        k = self.k_norm(qk[:, self.q_size :].view(t, self.num_kv_heads, self.head_dim))
        return apply_rotary(q, ctx.cos, ctx.sin), apply_rotary(k, ctx.cos, ctx.sin)
