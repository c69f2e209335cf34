"""AWQ int4 checkpoints (AutoAWQ's "GEMM" layout): the config, the packing, dequantization.

A quantized linear ``y = x @ W^T + b`` (W: [out, in]) is stored as three tensors that hold
W transposed, ``in`` rows by ``out`` columns, quantized per group of ``group_size`` input rows:

    qweight  [in, out / 8]            int32   8 four-bit values q per int32
    qzeros   [in / group, out / 8]    int32   8 four-bit zero points z per int32
    scales   [in / group, out]        float16 one scale s per (group, column)

    W^T[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n]

The packing and the exact dequantization live in kernels/awq_pack.py (the kernels use them
too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kernels.awq_pack import BITS, PACK

log = logging.getLogger(__name__)


SUPPORTED = "quant_method awq, bits 4, version gemm, zero_point true"
# Keys transformers writes into an AwqConfig that say how *it* runs the model (fused
# modules, kernel backend), not how the weights are stored: read and ignored.
_RUNTIME_KEYS = frozenset(
    {"backend", "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config"}
)
_FORMAT_KEYS = frozenset(
    {"quant_method", "bits", "group_size", "zero_point", "version", "modules_to_not_convert"}
)


@dataclass(frozen=True)
class AwqConfig:
    """The part of config.json's quantization_config that fixes the weight format."""

    group_size: int  # input rows per scale/zero; -1: one group over all input rows
    modules_to_not_convert: tuple[str, ...] = ()

    def group_of(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def converts(self, module_name: str) -> bool:
        """Whether the checkpoint holds this linear quantized: transformers' rule, a module
        stays float when any entry of modules_to_not_convert is a substring of its name."""
        return not any(key in module_name for key in self.modules_to_not_convert)


def _refuse(what: str, why: str) -> ValueError:
    return ValueError(
        f"quantization_config {what} is not supported ({why}); supported: {SUPPORTED}"
    )


def _as_dict(raw: Any) -> dict[str, Any]:
    """config.json's quantization_config, a dict or a transformers QuantizationConfig."""
    return dict(raw) if isinstance(raw, dict) else dict(raw.to_dict())


def parse_quantization_config(raw: Any) -> AwqConfig | None:
    """None for a float checkpoint; the AwqConfig of a supported AWQ one.

    Raises ValueError naming the first key whose value radixserve cannot serve."""
    if raw is None:
        return None
    qc = _as_dict(raw)
    method = str(qc.get("quant_method", "")).lower()
    if method != "awq":
        raise _refuse(f"quant_method {qc.get('quant_method')!r}", "only AWQ int4 loads")
    unknown = sorted(set(qc) - _FORMAT_KEYS - _RUNTIME_KEYS)
    if unknown:
        raise _refuse(f"key {unknown[0]!r}", "radixserve does not know what it changes")
    if qc.get("bits", BITS) != BITS:
        raise _refuse(f"bits {qc.get('bits')!r}", "the kernels unpack 4-bit values only")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"version {qc.get('version')!r}", "gemv and other layouts pack differently")
    if not qc.get("zero_point", True):
        raise _refuse("zero_point false", "symmetric AWQ checkpoints are not implemented")
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or group > 0):
        raise _refuse(f"group_size {group!r}", "a positive integer or -1")
    skip = qc.get("modules_to_not_convert") or []
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise _refuse(f"modules_to_not_convert {skip!r}", "a list of module names")
    ignored = sorted(k for k in _RUNTIME_KEYS if k in qc)
    if ignored:
        log.info("AWQ: ignoring transformers' runtime options %s", ignored)
    return AwqConfig(group_size=group, modules_to_not_convert=tuple(skip))


def check_linear(name: str, in_features: int, out_features: int, cfg: AwqConfig) -> int:
    """The group size of one quantized linear; ValueError naming it when its shape cannot be
    stored in AWQ's layout."""
    group = cfg.group_of(in_features)
    if in_features % group:
        raise ValueError(
            f"AWQ: {name} has {in_features} input features, not a multiple of "
            f"quantization_config group_size {group}"
        )
    if out_features % PACK:
        raise ValueError(
            f"AWQ: {name} has {out_features} output features, not a multiple of {PACK} "
            "(8 four-bit values per int32)"
        )
    return group


def packed_shapes(in_features: int, out_features: int, group: int) -> dict[str, tuple[int, ...]]:
    """The checkpoint shape of each tensor of one quantized linear."""
    return {
        "qweight": (in_features, out_features // PACK),
        "qzeros": (in_features // group, out_features // PACK),
        "scales": (in_features // group, out_features),
    }
