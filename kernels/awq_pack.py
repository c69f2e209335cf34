"""AWQ's packed int4 layout (AutoAWQ "GEMM"): the constants, unpacking, exact dequantization.

Columns 8c .. 8c+7 share int32 c, interleaved: nibble i (bits 4i .. 4i+3) holds column
8c + AWQ_ORDER[i]. In float32 the dequantized product is exact (q - z is a small integer, s
has 11 significant bits), so the weights are the checkpoint's own values.
"""

from __future__ import annotations

import torch

BITS = 4
PACK = 32 // BITS  # values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Bit offset of column j (of its 8) inside its int32: 4 * (nibble holding j).
COLUMN_SHIFTS = tuple(BITS * AWQ_ORDER.index(j) for j in range(PACK))  # 0 16 4 20 8 24 12 28


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[R, C / 8] int32 -> [R, C] int32 values 0..15, in column order."""
    shifts = torch.tensor(COLUMN_SHIFTS, dtype=torch.int32, device=packed.device)
    # An arithmetic shift keeps the sign bits above nibble 7; the mask drops them.
    values = (packed[:, :, None] >> shifts) & 0xF  # [R, C/8, 8]
    return values.reshape(packed.shape[0], -1)


def dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int
) -> torch.Tensor:
    """W^T as [in, out] float32, exactly (see the module docstring)."""
    rows, cols = qweight.shape[0], scales.shape[1]
    q = unpack(qweight).view(rows // group, group, cols)  # [G, group, out]
    z = unpack(qzeros)[:, None, :]  # [G, 1, out]
    return ((q - z).float() * scales.float()[:, None, :]).view(rows, cols)
