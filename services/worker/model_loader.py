"""Loads an HF-format model folder into radixserve's own model classes.

The model is built on the meta device first, so no time or memory goes into random
initialisation; safetensors weights are read memory-mapped and copied once. AWQ int4
checkpoints stay packed on CUDA and are dequantized once at load elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from services.worker.layers import AwqLinear, Linear
from services.worker.models import get_model_class
from services.worker.models.llama import LlamaForCausalLM
from services.worker.quant.awq import AwqConfig, parse_quantization_config

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --cpu-linear auto keeps the dense weights beside the packed ones up to this size.
AUTO_HYBRID_MAX_BYTES = 2 << 30


def load_config(model_path: str) -> PretrainedConfig:
    return AutoConfig.from_pretrained(model_path)


def checkpoint_dtype(config: PretrainedConfig) -> torch.dtype | None:
    """config.json's ``dtype`` (or ``torch_dtype``); None unless one of the three."""
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = _DTYPES.get(declared.removeprefix("torch."))
    return declared if declared in _DTYPES.values() else None


def resolve_dtype(name: str, config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """ "auto": the checkpoint's dtype. On CUDA a float32 or undeclared one runs in bfloat16;
    on CPU float32 stays float32 (exact, and the C kernels are fast there)."""
    if name != "auto":
        return _DTYPES[name]
    declared = checkpoint_dtype(config)
    if device.type != "cuda":
        return declared or torch.float32
    return declared if declared in (torch.bfloat16, torch.float16) else torch.bfloat16


def architecture_of(config: PretrainedConfig) -> str:
    archs = getattr(config, "architectures", None) or []
    if not archs:
        raise ValueError("config.json names no architectures; cannot pick a model class")
    return archs[0]


def safetensors_files(model_path: str) -> list[Path]:
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_path}")
    return files


FINGERPRINT_SAMPLES = 16  # blocks of each file hashed besides its header
FINGERPRINT_BLOCK = 4096


def weights_fingerprint(files: list[Path]) -> str:
    """A short hash of each file's size, header and a few sampled blocks (no gigabytes read)."""
    h = hashlib.blake2b(digest_size=8)
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}|{size}|".encode())
        with open(f, "rb") as fh:
            head = fh.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(fh.read(min(header_len, size)))
            for i in range(FINGERPRINT_SAMPLES):
                fh.seek(size * i // FINGERPRINT_SAMPLES)
                h.update(fh.read(FINGERPRINT_BLOCK))
    return h.hexdigest()


def iter_tensors(files: list[Path], progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)


def num_parameters(model: torch.nn.Module) -> int:
    """Parameters of the model as trained: an AWQ linear counts its in x out weights."""
    awq = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, AwqLinear))
    return sum(p.numel() for p in model.parameters()) + awq


def weight_nbytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers (AWQ's packed weights are buffers)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.nbytes for t in tensors if not t.is_meta)


def awq_config(config: PretrainedConfig) -> AwqConfig | None:
    """None for float weights; ValueError names a quantization_config we cannot serve."""
    return parse_quantization_config(getattr(config, "quantization_config", None))


def load_model(
    model_path: str,
    dtype: torch.dtype,
    device: torch.device,
    config: PretrainedConfig | None = None,
    progress: bool = True,
    dequantize: bool | None = None,
) -> tuple[LlamaForCausalLM, PretrainedConfig]:
    """Builds and fills the model; dequantize (AWQ) None means everywhere but CUDA. Raises
    ValueError naming an unknown architecture, a bad tensor or quantization_config."""
    config = config if config is not None else load_config(model_path)
    cls = get_model_class(architecture_of(config))
    quant = awq_config(config)
    files = safetensors_files(model_path)
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype)
    if quant is not None:
        model.use_awq(quant)  # after .to(dtype): the packed buffers keep their own dtypes
    model = model.to_empty(device=device)
    model.load_weights(iter_tensors(files, progress))
    if quant is not None and (dequantize if dequantize is not None else device.type != "cuda"):
        _dequantize(model, dtype)
    model.eval()
    log.info(
        "loaded %s (%d parameters, %s) from %s",
        cls.__name__,
        num_parameters(model),
        dtype,
        model_path,
    )
    return model, config


def _dequantize(model: LlamaForCausalLM, dtype: torch.dtype) -> None:
    packed = weight_nbytes(model)
    count = model.dequantize_awq()
    dense = weight_nbytes(model)
    log.info(
        "AWQ: %d linears dequantized to %s at load: weights %.1f MiB packed -> %.1f MiB "
        "(+%.1f MiB; the GPU path keeps them packed)",
        count,
        dtype,
        packed / 2**20,
        dense / 2**20,
        (dense - packed) / 2**20,
    )


def eos_token_ids(model_path: str, config: PretrainedConfig) -> list[int]:
    """EOS ids from generation_config.json when present, else from config.json."""
    gen = Path(model_path) / "generation_config.json"
    eos = None
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


def pack_for_cpu(model: LlamaForCausalLM, mode: str, device: torch.device) -> int:
    """Packs the CPU linears per --cpu-linear; returns how many. Call after sizing the pool."""
    if device.type != "cpu" or mode == "plain":
        return 0
    if mode == "auto":
        # Keeping the dense weights speeds decode but doubles the linears' memory.
        dense = sum(m.weight.nbytes for m in model.modules() if isinstance(m, Linear))
        mode = "hybrid" if dense <= AUTO_HYBRID_MAX_BYTES else "packed"
    packed = model.pack_linears(keep_plain=mode == "hybrid")
    log.info("%d linears packed for oneDNN (--cpu-linear %s)", packed, mode)
    return packed
