"""A batch's integer inputs, computed on the host and moved to the device in one copy.

Everything here is O(new tokens + requests), never O(context): kernels read the
request-to-slot table for that. On CUDA the arrays go through one pinned staging buffer.

    staging layout (int64):  ids[T] positions[T] out_slots[T] token_rows[T]
                             req_slots[B] prefix_lens[B] extend_lens[B] seq_lens[B] qo_indptr[B+1]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.attention.base import AttentionMeta


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_slots: torch.Tensor  # [T] int64: KV slot of each new token
    token_rows: torch.Tensor  # [T] int64: table row of each new token
    req_slots: torch.Tensor  # [B] int32
    prefix_lens: torch.Tensor  # [B] int32
    extend_lens: torch.Tensor  # [B] int32
    seq_lens: torch.Tensor  # [B] int32
    qo_indptr: torch.Tensor  # [B+1] int32
    max_seq_len: int
    max_extend_len: int

    @classmethod
    def of_flat(cls, flat: torch.Tensor, t: int, b: int, max_seq: int, max_ext: int) -> StepInputs:
        """Views of one int64 tensor in host_arrays' layout: 4 T + 5 B + 1 words."""
        head, tail = flat[: 4 * t].view(4, t), flat[4 * t :].to(torch.int32)
        return cls(
            input_ids=head[0],
            positions=head[1],
            out_slots=head[2],
            token_rows=head[3],
            req_slots=tail[:b],
            prefix_lens=tail[b : 2 * b],
            extend_lens=tail[2 * b : 3 * b],
            seq_lens=tail[3 * b : 4 * b],
            qo_indptr=tail[4 * b :],
            max_seq_len=max_seq,
            max_extend_len=max_ext,
        )

    def attention_meta(self, is_decode: bool, req_to_token: torch.Tensor) -> AttentionMeta:
        return AttentionMeta(
            is_decode=is_decode,
            out_slots=self.out_slots,
            qo_indptr=self.qo_indptr,
            req_to_token=req_to_token,
            req_slots=self.req_slots,
            prefix_lens=self.prefix_lens,
            extend_lens=self.extend_lens,
            seq_lens=self.seq_lens,
            max_seq_len=self.max_seq_len,
            max_extend_len=self.max_extend_len,
        )


def host_arrays(
    ids: Sequence[np.ndarray], out_slots: Sequence[np.ndarray], rows: np.ndarray, prefix: np.ndarray
) -> tuple[list[np.ndarray], int, int]:
    extend = np.fromiter((len(i) for i in ids), dtype=np.int64, count=len(ids))  # [B]
    qo = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(extend, out=qo[1:])
    total = int(qo[-1])
    # position of new token j of request b: prefix[b] + (j - qo[b])
    positions = np.arange(total, dtype=np.int64) + np.repeat(prefix - qo[:-1], extend)
    arrays = [
        np.concatenate(ids) if ids else np.zeros(0, np.int64),
        positions,
        np.concatenate(out_slots) if out_slots else np.zeros(0, np.int64),
        np.repeat(rows, extend),
        rows,
        prefix,
        extend,
        prefix + extend,
        qo,
    ]
    return arrays, total, len(ids)


class StepStager:
    def __init__(self, device: torch.device):
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # the last copy out of _pinned

    def stage(
        self,
        ids: Sequence[np.ndarray],
        out_slots: Sequence[np.ndarray],
        req_slots: Sequence[int],
        prefix_lens: Sequence[int],
    ) -> StepInputs:
        rows = np.asarray(req_slots, dtype=np.int64)
        prefix = np.asarray(prefix_lens, dtype=np.int64)
        arrays, t, b = host_arrays(ids, out_slots, rows, prefix)
        max_seq = int(arrays[7].max()) if b else 0
        max_ext = int(arrays[6].max()) if b else 0
        return StepInputs.of_flat(
            self._to_device(arrays, 4 * t + 5 * b + 1), t, b, max_seq, max_ext
        )

    def _to_device(self, arrays: list[np.ndarray], n: int) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.from_numpy(np.concatenate(arrays))
        buf = self._buffer(n)
        np.concatenate(arrays, out=buf.numpy()[:n])
        out = buf[:n].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out

    def _buffer(self, n: int) -> torch.Tensor:
        """The pinned buffer, once the previous copy out of it is done."""
        if self._copied is not None:
            self._copied.synchronize()
        if self._pinned is None or self._pinned.numel() < n:
            size = max(n, 2 * (0 if self._pinned is None else self._pinned.numel()), 4096)
            self._pinned = torch.empty(size, dtype=torch.int64, pin_memory=True)
        return self._pinned
