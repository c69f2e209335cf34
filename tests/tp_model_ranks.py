"""The rank side of tests/unit/test_tp_model.py: what each spawned rank runs. Apart from
the test module so that a rank imports radixserve's worker alone (not conftest, whose
transformers model classes cost seconds per rank on a busy 2-core machine)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from services.worker.parallel.group import TpGroup
from services.worker.parallel.rank_runner import RankModel, RankShape, make_step

TOL = 1e-4
MAX_NEW = 4
SHAPE = RankShape(num_slots=512, max_running_requests=8, max_context=128)
PROMPTS = [[5, 9, 14, 3, 77, 41, 8], [120, 4], [33, 33, 60, 200, 7, 19, 2, 88, 150, 6, 71]]
SHARED = 4  # the extra request reuses this many tokens of prompt 0's KV
EXTRA = [250, 13, 99]


def slots_of(i: int) -> np.ndarray:
    """Request i's KV slots, one per position (slot 0 is the pool's padding)."""
    span = max(len(p) for p in PROMPTS) + MAX_NEW + len(EXTRA)
    return 1 + i * span + np.arange(span, dtype=np.int64)


def drive(tp: TpGroup, folder: str) -> dict[str, torch.Tensor] | None:
    """Rank 0 runs the steps and returns what it saw; the others follow."""
    rank = RankModel(folder, tp, torch.device("cpu"), SHAPE)
    if not tp.is_first:
        rank.follow()
        return None
    seen: dict[str, torch.Tensor] = {}
    ids = [np.asarray(p, np.int64) for p in PROMPTS]
    lens = [len(p) for p in PROMPTS]
    out = [slots_of(i)[:n] for i, n in enumerate(lens)]
    rows = np.arange(sum(lens))
    logits = rank.lead(make_step(ids, out, range(3), [0, 0, 0], False, rows))
    seen["prefill"] = logits
    seen["scored"] = rank.lead_logits(rows[::-1][:5])  # prompt logprobs ask for rows again
    ends = np.cumsum(lens) - 1
    tokens = [[int(logits[e].argmax())] for e in ends]
    for k in range(1, MAX_NEW):
        pos = [n + k - 1 for n in lens]
        step = make_step(
            [np.array([t[-1]]) for t in tokens],
            [slots_of(i)[p : p + 1] for i, p in enumerate(pos)],
            range(3),
            pos,
            True,
            np.arange(3),
        )
        logits = rank.lead(step)
        seen[f"decode{k}"] = logits
        for i, t in enumerate(tokens):
            t.append(int(logits[i].argmax()))
    seen["tokens"] = torch.tensor(tokens)
    # request 3 starts on the first SHARED tokens of request 0's KV
    prefix = slots_of(0)[:SHARED]
    step = make_step(
        [np.asarray(EXTRA, np.int64)],
        [slots_of(3)[SHARED : SHARED + len(EXTRA)]],
        [3],
        [SHARED],
        False,
        np.arange(len(EXTRA)),
        prefixes=[(3, prefix)],
    )
    seen["cached"] = rank.lead(step)
    rank.stop()
    return seen


def check(tp: TpGroup, cases: list[tuple[str, dict[str, dict[str, torch.Tensor]]]]) -> None:
    """Every case's model driven on these ranks; rank 0 compares with each reference."""
    for folder, wants in cases:
        seen = drive(tp, folder)
        if seen is None:
            continue
        for ref, want in wants.items():
            for key, expected in want.items():
                where = f"{Path(folder).name}: {key} at tp {tp.world} against {ref}"
                if key == "tokens":
                    assert torch.equal(seen[key], expected), where
                else:
                    torch.testing.assert_close(seen[key], expected, atol=TOL, rtol=0, msg=where)
