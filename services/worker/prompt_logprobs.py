"""Prompt logprobs: raw log_softmax of the logits at the prompt positions a request asks
to score, with the top-n alternatives. Only the scored rows of the hidden states go
through the lm_head, so a request that asks nothing costs nothing here.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from services.worker.batch import PromptScore, Scored

# Bounds a long prompt's [rows, vocab] logits instead of growing with the prompt.
ROWS_PER_BLOCK = 64


def score(
    logits_of: Callable[[np.ndarray], torch.Tensor],
    qo_starts: list[int],
    asks: list[PromptScore | None],
    rows_per_block: int = ROWS_PER_BLOCK,
) -> list[list[Scored] | None]:
    """Per request: its scored prompt tokens, or None where none were asked.
    ``logits_of(rows)``: float32 logits of those hidden-state rows."""
    wanted = [(i, a) for i, a in enumerate(asks) if a is not None and len(a.targets)]
    out: list[list[Scored] | None] = [None] * len(asks)
    if not wanted:
        return out
    rows = np.concatenate([qo_starts[i] + a.row + np.arange(len(a.targets)) for i, a in wanted])
    targets = np.concatenate([a.targets for _, a in wanted]).astype(np.int64)
    n_top = max(a.top for _, a in wanted)
    blocks = [
        _score_rows(logits_of, rows[lo : lo + rows_per_block], targets[lo:], n_top)
        for lo in range(0, len(rows), rows_per_block)
    ]
    # One copy to the host for the whole batch (a sync per block would stall the device).
    chosen = torch.cat([b[0] for b in blocks]).tolist()
    values = torch.cat([b[1] for b in blocks]).tolist()
    indices = torch.cat([b[2] for b in blocks]).tolist()
    at = 0
    for i, a in wanted:
        entries: list[Scored] = []
        for j in range(at, at + len(a.targets)):
            top = list(zip(indices[j][: a.top], values[j][: a.top], strict=True)) if a.top else []
            entries.append((int(targets[j]), chosen[j], top))
        out[i] = entries
        at += len(a.targets)
    return out


def _score_rows(
    logits_of: Callable[[np.ndarray], torch.Tensor],
    rows: np.ndarray,
    targets: np.ndarray,
    n_top: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target logprobs [r], top values [r, n_top], top ids [r, n_top]); n_top may be 0."""
    logprobs = torch.log_softmax(logits_of(rows), dim=-1)  # [r, vocab] float32
    want = torch.from_numpy(targets[: len(rows)]).to(logprobs.device)[:, None]
    best = logprobs.topk(n_top, dim=-1)  # n_top 0: empty [r, 0]
    return logprobs.gather(1, want)[:, 0], best.values, best.indices
