"""Llama-family decoders: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

One implementation, a few switches read from the HF config. The runner's interface:

    model.forward(input_ids [T], positions [T], meta) -> hidden [T, hidden_size]
    model.compute_logits(hidden [N, hidden_size])     -> logits [N, vocab] float32
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import gemm as cpu_gemm
from services.worker.attention.base import AttentionBackend, AttentionMeta
from services.worker.cpu_linear import (
    PackedLinear,
    default_kernel_rows,
    default_kernel_rows16,
    onednn_available,
)
from services.worker.forward_context import ForwardContext
from services.worker.kv_pool import KVPool
from services.worker.layers import (
    Attention,
    AwqLinear,
    FusedLinear,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
)
from services.worker.quant.awq import AwqConfig, check_linear

# Checkpoint tensors that land in a fused parameter: (fused name, checkpoint name, shard).
_STACKED = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A tied lm_head gets a packed copy of the embedding table up to this size; a larger one
# runs on the dense table itself (no extra memory), via the C kernel for few rows.
TIED_HEAD_COPY_MAX_BYTES = 64 << 20
TIED_HEAD_KERNEL_ROWS = 24


# Rows of one forward of a CPU prefill batch; a larger one runs as groups of whole requests,
# so the activations stay in cache.
CPU_EXTEND_ROWS = 2048


def split_extend(meta: AttentionMeta, rows: int) -> Iterator[tuple[int, int, AttentionMeta]]:
    """(first row, end row, metadata) of groups of whole requests of at most ``rows`` new
    tokens each (a larger request alone)."""
    qo = meta.qo_indptr.tolist()
    first = 0
    while first < len(qo) - 1:
        end = first + 1
        while end < len(qo) - 1 and qo[end + 1] - qo[first] <= rows:
            end += 1
        seq_lens, extend_lens = meta.seq_lens[first:end], meta.extend_lens[first:end]
        sub = dataclasses.replace(
            meta,
            out_slots=meta.out_slots[qo[first] : qo[end]],
            qo_indptr=meta.qo_indptr[first : end + 1] - qo[first],
            req_slots=meta.req_slots[first:end],
            prefix_lens=meta.prefix_lens[first:end],
            extend_lens=extend_lens,
            seq_lens=seq_lens,
            max_seq_len=int(seq_lens.max()),
            max_extend_len=int(extend_lens.max()),
        )
        yield qo[first], qo[end], sub
        first = end


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(
            hidden=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=head_dim_of(config),
            layer_id=layer_id,
            qkv_bias=qkv_bias,
            o_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm_eps=eps if qk_norm else None,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            bias=bool(getattr(config, "mlp_bias", False)),
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), ctx)  # x, h: [T, hidden]
        x, normed = self.post_attention_layernorm.add_forward(x, h)
        return x + self.mlp(normed)


class DecoderBody(nn.Module):
    """Named ``model`` inside the causal LM so parameter names match the checkpoints."""

    def __init__(self, config, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, qkv_bias, qk_norm) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    qkv_bias_default = False
    qk_norm = False

    def __init__(
        self, config, backend: AttentionBackend | None = None, kv_pool: KVPool | None = None
    ):
        super().__init__()
        self.config = config
        qkv_bias = self.qkv_bias_default or bool(getattr(config, "attention_bias", False))
        self.model = DecoderBody(config, qkv_bias, self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Tied: no second Parameter object, so moving the model can never untie them.
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.tied_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.rotary = RotaryEmbedding(config, head_dim_of(config))
        self.backend = backend
        self.kv_pool = kv_pool

    def attach(self, backend: AttentionBackend, kv_pool: KVPool) -> None:
        self.backend, self.kv_pool = backend, kv_pool

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta
    ) -> torch.Tensor:
        rows = input_ids.shape[0]
        if meta.is_decode or input_ids.device.type != "cpu" or rows <= CPU_EXTEND_ROWS:
            return self._forward(input_ids, positions, meta)
        return torch.cat(
            [
                self._forward(input_ids[s:e], positions[s:e], sub)
                for s, e, sub in split_extend(meta, CPU_EXTEND_ROWS)
            ]
        )

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # x: [T, hidden]
        ctx = self.context(positions, meta, x.dtype)
        for layer in self.model.layers:
            x = layer(x, ctx)
        return self.model.norm(x)

    def context(
        self, positions: torch.Tensor, meta: AttentionMeta, dtype: torch.dtype
    ) -> ForwardContext:
        assert self.backend is not None and self.kv_pool is not None, (
            "attach() a backend and a KV pool first"
        )
        cos, sin = self.rotary.cos_sin(positions, dtype)
        self.backend.prepare(meta)
        return ForwardContext(positions, cos, sin, meta, self.backend, self.kv_pool)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).float()  # [N, vocab]
        if self.tied_head is not None:
            return self.tied_head(hidden).float()
        return torch.nn.functional.linear(hidden, self.model.embed_tokens.weight).float()

    def pack_linears(self, keep_plain: bool = False) -> int:
        """After load_weights: packs every projection where cpu_linear supports it (no-op on
        CUDA); a tied embedding table stays dense for the lookup. Returns how many."""
        packed = sum(m.pack(keep_plain) for m in self.modules() if isinstance(m, Linear))
        if self.lm_head is None and packed:
            table = self.model.embed_tokens.weight
            if table.nbytes <= TIED_HEAD_COPY_MAX_BYTES:
                self.tied_head = PackedLinear(table, keep_plain=True)
            else:
                self.tied_head = _dense_head(table)
        return packed

    @property
    def packed_linears(self) -> int:
        return sum(isinstance(m, Linear) and m.packed is not None for m in self.modules())

    def checkpoint_tensors(self) -> dict[str, tuple[torch.Size, torch.dtype | None]]:
        """Every tensor the checkpoint must hold: shape, and dtype where only one will do
        (None: any float dtype, converted on load)."""
        names: dict[str, tuple[torch.Size, torch.dtype | None]] = {}
        modules = dict(self.named_modules())
        for name, tensor, is_buffer in self._tensors():
            module_name, _, leaf = name.rpartition(".")
            module = modules[module_name]
            dtype = tensor.dtype if is_buffer else None
            shards = _shards_of(module_name) if isinstance(module, FusedLinear | AwqLinear) else []
            for ckpt_module, shard in shards:
                view = module.shard_view(leaf, tensor, shard)
                names[ckpt_module + "." + leaf] = (view.shape, dtype)
            if not shards:
                names[name] = (tensor.shape, dtype)
        return names

    def checkpoint_names(self) -> dict[str, torch.Size]:
        return {name: shape for name, (shape, _) in self.checkpoint_tensors().items()}

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor, bool]]:
        for name, p in self.named_parameters():
            yield name, p, False
        for name, b in self.named_buffers():
            yield name, b, True

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors in, converted to the model's dtype and device. Raises
        ValueError naming a missing tensor or one whose shape (or packed dtype) differs."""
        expected = self.checkpoint_tensors()
        own = {name: t for name, t, _ in self._tensors()}
        seen: set[str] = set()
        for name, tensor in tensors:
            if name.endswith(_IGNORED_SUFFIXES) or (
                name == "lm_head.weight" and self.lm_head is None
            ):
                continue
            if name not in expected:
                continue
            shape, dtype = expected[name]
            if tuple(tensor.shape) != tuple(shape):
                raise ValueError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(shape)}"
                )
            if dtype is not None and tensor.dtype != dtype:
                raise ValueError(f"tensor {name!r} is {tensor.dtype}, the model expects {dtype}")
            self._target(name, own).copy_(tensor)
            seen.add(name)
        missing = [n for n in expected if n not in seen]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"checkpoint is missing tensor {missing[0]!r}{more}")

    def _target(self, name: str, own: dict[str, torch.Tensor]) -> torch.Tensor:
        for fused, ckpt, shard in _STACKED:
            marker = "." + ckpt + "."
            if marker in name:
                fused_name = name.replace(marker, "." + fused + ".")
                module_name, _, leaf = fused_name.rpartition(".")
                module = self.get_submodule(module_name)
                assert isinstance(module, FusedLinear | AwqLinear)
                return module.shard_view(leaf, own[fused_name].data, shard)
        return own[name].data

    def use_awq(self, cfg: AwqConfig) -> int:
        """Before loading: quantized decoder projections become AwqLinears (lm_head stays
        float); a fused one must be all quantized or all float. Returns how many."""
        replaced = 0
        for name, module in list(self.named_modules()):
            if not isinstance(module, Linear) or name == "lm_head":
                continue
            parts = [ckpt for ckpt, _ in _shards_of(name)] or [name]
            kept = [p for p in parts if not cfg.converts(p)]
            if len(kept) == len(parts):
                continue
            if kept:
                raise ValueError(
                    f"AWQ: quantization_config modules_to_not_convert "
                    f"{list(cfg.modules_to_not_convert)} keeps {kept} float but not the rest of "
                    f"{parts}, which radixserve runs as one fused linear"
                )
            sizes = getattr(module, "shard_sizes", [module.out_features])
            for part, size in zip(parts, sizes, strict=True):
                check_linear(part, module.in_features, size, cfg)
            group = cfg.group_of(module.in_features)
            parent, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(parent), leaf, AwqLinear.like(module, group))
            replaced += 1
        return replaced

    def dequantize_awq(self) -> int:
        """Every AwqLinear becomes a float Linear, ready for pack_linears. Returns how many."""
        awq = [(n, m) for n, m in self.named_modules() if isinstance(m, AwqLinear)]
        for name, module in awq:
            parent, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(parent), leaf, module.to_dense())
        return len(awq)


def _shards_of(module_name: str) -> list[tuple[str, int]]:
    """(checkpoint module name, shard) stacked in a fused module; [] if not fused."""
    out = []
    for fused, ckpt, shard in _STACKED:
        if module_name.endswith("." + fused):
            out.append((module_name[: -len(fused)] + ckpt, shard))
    return out


def _dense_head(table: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x @ table^T on the unpacked table, no copy: C kernel for few rows, oneDNN for more."""
    op = torch.ops.mkldnn._linear_pointwise.default
    if table.dtype == torch.float32:
        kernel = cpu_gemm.load() if cpu_gemm.supports(table) else None
        crossing = default_kernel_rows()
    else:
        kernel = cpu_gemm.load16() if cpu_gemm.supports16(table) else None
        crossing = default_kernel_rows16(table.dtype)
    kernel_rows = max(crossing, TIED_HEAD_KERNEL_ROWS) if kernel else 0
    dnn = onednn_available(table.dtype)

    def head(x: torch.Tensor) -> torch.Tensor:
        if kernel is not None and x.shape[0] < kernel_rows and x.dtype == table.dtype:
            return kernel(x, table)
        if x.shape[0] < 2 or not dnn:
            return F.linear(x, table)
        return op(x, table, None, "none", [], "")

    return head


class MistralForCausalLM(LlamaForCausalLM):
    """Same weights and math as Llama (sliding window not applied; see docs)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias_default = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
