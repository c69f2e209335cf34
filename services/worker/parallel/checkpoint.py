"""Each rank reads only its slices of the safetensors: no rank loads the whole model.

``get_slice(name)[rows]`` on the memory-mapped file reads those rows alone. Modules name
their slices (``slices``); this maps them to checkpoint names and refuses misfitting shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from services.worker.parallel.linear import SliceTarget
from services.worker.parallel.partition import Span

# (fused module name, checkpoint module name, shard), as models/llama.py's _STACKED.
Stacked = Sequence[tuple[str, str, int]]


class ShardedCheckpoint:
    """Every tensor of a list of safetensors files, by name, read whole or by slice."""

    def __init__(self, files: Iterable[Path]):
        self._file_of: dict[str, object] = {}
        for f in files:
            handle = safe_open(str(f), framework="pt", device="cpu")
            for name in handle.keys():
                self._file_of[name] = handle
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, span: Span | None = None) -> torch.Tensor:
        """The tensor, or its rows ``span`` along ``dim``; only those bytes are read."""
        part = self._slice(name)
        if dim is None or span is None:
            tensor = part[:]
        else:
            index = [slice(None)] * len(part.get_shape())
            index[dim] = slice(span.start, span.stop)
            tensor = part[tuple(index)]
        self.bytes_read += tensor.nbytes
        return tensor

    def _slice(self, name: str):
        if name not in self._file_of:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return self._file_of[name].get_slice(name)  # type: ignore[attr-defined]


def checkpoint_module(module_name: str, shard: int, stacked: Stacked) -> str:
    for fused, ckpt, index in stacked:
        if index == shard and module_name.endswith("." + fused):
            return module_name[: -len(fused)] + ckpt
    return module_name


def load_slice(ckpt: ShardedCheckpoint, name: str, target: SliceTarget) -> None:
    """Reads one slice into its target; ValueError names a tensor whose shape differs."""
    full = ckpt.shape(name)
    if target.dim is not None and target.span is not None and target.span.stop > full[target.dim]:
        raise ValueError(
            f"tensor {name!r} has shape {tuple(full)}; this rank needs rows "
            f"[{target.span.start}, {target.span.stop}) of dimension {target.dim}"
        )
    tensor = ckpt.read(name, target.dim, target.span)
    if tuple(tensor.shape) != tuple(target.target.shape):
        raise ValueError(
            f"tensor {name!r} gives this rank shape {tuple(tensor.shape)}, the model "
            f"expects {tuple(target.target.shape)}"
        )
    target.target.copy_(tensor)


def load_sharded(
    model: nn.Module,
    ckpt: ShardedCheckpoint,
    stacked: Stacked = (),
    skip: Callable[[str], bool] = lambda name: False,
) -> int:
    """Fills ``model``: modules with ``slices`` by slice, everything else whole. ``skip``:
    tensors the checkpoint need not hold. Returns the bytes read; ValueError names a
    missing or misfitting tensor."""
    covered: set[str] = set()
    for module_name, module in model.named_modules():
        if not hasattr(module, "slices"):
            continue
        for target in module.slices():
            base = checkpoint_module(module_name, target.shard, stacked)
            load_slice(ckpt, f"{base}.{target.leaf}", target)
        covered |= {f"{module_name}.{n}" for n, _ in module.named_parameters()}
        if hasattr(module, "zero_padding"):
            module.zero_padding()
    own = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in own:
        if name in covered or skip(name):
            continue
        load_slice(ckpt, name, SliceTarget(0, "", None, None, tensor.data))
    return ckpt.bytes_read
