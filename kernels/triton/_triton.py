"""Imports Triton so that its kernels also run on machines without a GPU.

Without CUDA it sets ``TRITON_INTERPRET=1`` (unless set) so the same kernels run on CPU
tensors; kernel modules import triton from here since Triton reads it at *decoration* time.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

__all__ = ["triton", "tl", "dot_precision", "sm_major", "check_head_dim_contiguous"]


def _interpret_language_library() -> None:
    """Makes Triton's own jit'd library functions (tl.sum, tl.zeros, ...) interpretable: when
    triton.language was imported before the variable was set (torch may do so), they stay
    compile-only and raise in interpreted kernels; rewrapping does what decoration would."""
    from triton.runtime.interpreter import InterpretedFunction

    wrapped: dict[int, InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "triton.language" or name.startswith("triton.language.")):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in wrapped:
                    wrapped[id(value)] = InterpretedFunction(value.fn)
                setattr(module, attr, wrapped[id(value)])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _interpret_bf16() -> None:
    """Makes the interpreter's bfloat16 tl.dot and rounding match the GPU's: it keeps bf16 as
    raw uint16 patterns and would multiply them as integers; widening to float32 is exact."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "widens_bf16", False):
        return

    def widen(h: interpreter.TensorHandle) -> interpreter.TensorHandle:
        if h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle(
            (h.data.astype(np.uint32) << 16).view(np.float32), tl.float32
        )

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    create_dot.widens_bf16 = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot
    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        """float32 -> bfloat16 rounded to nearest even as on the GPU (the interpreter truncates)."""
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast(self, src, dst_type)
        bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = np.where(np.isnan(src.data), 0x7FC0, rounded).astype(np.uint16)
        return interpreter.TensorHandle(out, tl.bfloat16)

    builder.cast_impl = cast_impl


if _interpreting():
    if isinstance(tl.zeros, JITFunction):
        _interpret_language_library()
    _interpret_bf16()


@functools.cache
def sm_major(device_index: int) -> int:
    """The GPU's compute capability major (8: Ampere, 9: Hopper); sizes tiles and pipelines."""
    return torch.cuda.get_device_capability(device_index)[0]


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs use exact products: tf32 (the GPU default) is off by ~1e-3 relative."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_head_dim_contiguous(*tensors: torch.Tensor) -> None:
    """The kernels address the last (head) dim with stride 1; every other stride is free."""
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"the kernels need the last dim contiguous, got strides {t.stride()}")
