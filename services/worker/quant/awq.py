"""AWQ int4 checkpoints (AutoAWQ's "GEMM" layout): the config, the packing, dequantization.

Layout and dequantization formula: docs/awq.md; the packing itself is kernels/awq_pack.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kernels.awq_pack import BITS, PACK

log = logging.getLogger(__name__)


SUPPORTED = "quant_method awq, bits 4, version gemm, zero_point true"
# Keys about how transformers runs the model, not how the weights are stored: ignored.
_RUNTIME_KEYS = frozenset(
    {"backend", "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config"}
)
_FORMAT_KEYS = frozenset(
    {"quant_method", "bits", "group_size", "zero_point", "version", "modules_to_not_convert"}
)


@dataclass(frozen=True)
class AwqConfig:
    group_size: int  # input rows per scale/zero; -1: one group over all input rows
    modules_to_not_convert: tuple[str, ...] = ()

    def group_of(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def converts(self, module_name: str) -> bool:
        """transformers' rule: a module stays float when any entry of
        modules_to_not_convert is a substring of its name."""
        return not any(key in module_name for key in self.modules_to_not_convert)


def _refuse(what: str, why: str) -> ValueError:
    return ValueError(
        f"quantization_config {what} is not supported ({why}); supported: {SUPPORTED}"
    )


def _as_dict(raw: Any) -> dict[str, Any]:
    return dict(raw) if isinstance(raw, dict) else dict(raw.to_dict())


def parse_quantization_config(raw: Any) -> AwqConfig | None:
    """None for a float checkpoint; raises ValueError naming the first unservable key."""
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
    """The group size of one linear; ValueError naming it if AWQ's layout cannot hold it."""
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
    return {
        "qweight": (in_features, out_features // PACK),
        "qzeros": (in_features // group, out_features // PACK),
        "scales": (in_features // group, out_features),
    }
