"""An AWQ int4 quantizer and packer for tests, written from the published format alone.

Independent of radixserve's loader on purpose (it imports nothing from services/): the
tests prove the loader against it. The format, as AutoAWQ's "GEMM" checkpoints store it:

* a linear's weight W [out, in] is quantized as its transpose, in groups of ``group``
  consecutive input rows: per (group, output column) a scale s and a zero point z,
  q = clamp(round(w / s) + z, 0, 15), and w is read back as (q - z) * s;
* qweight [in, out / 8] int32, qzeros [in / group, out / 8] int32, scales [in / group, out]
  float16; tensor names ``<module>.qweight``, ``.qzeros``, ``.scales`` (biases stay float);
* 8 values per int32, value of column 8c + ORDER[i] in bits 4i .. 4i+3, ORDER = 0 2 4 6 1 3 5 7;
* config.json: ``quantization_config`` {quant_method awq, bits 4, group_size, zero_point
  true, version gemm, modules_to_not_convert}.

    folder, twin, deq = write_awq_model(float_folder, out_folder, group=32)

``twin`` is a float32 model folder whose weights are exactly the dequantized values (and the
other tensors rounded to float16, as the AWQ folder stores them): the reference transformers
runs. ``deq`` maps each quantized linear's name to its dequantized W [out, in] float32.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Quantized:
    q: torch.Tensor  # [in, out] int64 0..15
    zeros: torch.Tensor  # [in / group, out] int64 0..15
    scales: torch.Tensor  # [in / group, out] float16

    def dequantized(self) -> torch.Tensor:
        """W [out, in] float32, computed from the integers (not from the packed words)."""
        group = self.q.shape[0] // self.scales.shape[0]
        z = self.zeros.repeat_interleave(group, 0)
        s = self.scales.float().repeat_interleave(group, 0)
        return ((self.q - z).float() * s).t().contiguous()


def quantize(w: torch.Tensor, group: int) -> Quantized:
    """Asymmetric min/max 4-bit quantization of W [out, in] per group of input rows."""
    wt = w.detach().double().t()  # [in, out]
    rows, cols = wt.shape
    g = wt.reshape(rows // group, group, cols)
    lo, hi = g.amin(1).clamp(max=0.0), g.amax(1).clamp(min=0.0)
    scales = ((hi - lo) / 15).clamp(min=1e-4).half()  # stored float16: quantize with it
    s = scales.double()
    zeros = (-lo / s).round().clamp(0, 15).long()
    q = ((g / s[:, None, :]).round() + zeros[:, None, :]).clamp(0, 15).long()
    return Quantized(q.reshape(rows, cols), zeros, scales)


def pack(values: torch.Tensor) -> torch.Tensor:
    """[R, C] ints 0..15 -> [R, C / 8] int32 in AWQ's nibble order."""
    v = values.numpy().astype(np.uint32)
    words = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for nibble, column in enumerate(ORDER):
        words |= v[:, column::8] << np.uint32(4 * nibble)
    return torch.from_numpy(words.view(np.int32).copy())


def awq_quantization_config(group: int, not_convert: list[str] | None = None) -> dict:
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": not_convert,
    }


def _is_quantized(name: str, not_convert: list[str]) -> bool:
    module = name.rpartition(".")[0]
    return (
        name.endswith(".weight")
        and module.rpartition(".")[2] in LINEARS
        and not any(k in module for k in not_convert)
    )


def write_awq_model(
    src: Path, dst: Path, group: int, not_convert: list[str] | None = None
) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """AWQ folder ``dst`` and its float32 twin ``dst``-twin from a float HF folder ``src``."""
    skip = list(not_convert or [])
    tensors = load_file(str(src / "model.safetensors"))
    awq: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not _is_quantized(name, skip):
            awq[name] = t.half()
            twin[name] = t.half().float()
            continue
        module = name[: -len(".weight")]
        qt = quantize(t, group)
        awq[module + ".qweight"] = pack(qt.q)
        awq[module + ".qzeros"] = pack(qt.zeros)
        awq[module + ".scales"] = qt.scales
        deq[module] = twin[name] = qt.dequantized()
    twin_dir = dst.with_name(dst.name + "-twin")
    for folder, weights in ((dst, awq), (twin_dir, twin)):
        shutil.copytree(src, folder)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = awq_quantization_config(group, not_convert)
    cfg["dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst, twin_dir, deq


def set_quantization_config(folder: Path, **changes) -> None:
    """Edits config.json's quantization_config (a key set to ... is removed)."""
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg["quantization_config"]
    for k, v in changes.items():
        if v is Ellipsis:
            qc.pop(k, None)
        else:
            qc[k] = v
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
