"""A whole tiny model split over 2 and 4 gloo ranks (parallel/shard_model.py and
rank_runner.py): rank 0 stages each step and sends it, the others follow. Logits within
1e-4 of transformers and of TP=1 (the worker's own unsharded model and loader), greedy
tokens equal, over a mixed prefill, decode steps, a request on a cached prefix (whose
table rows travel in the step) and prompt rows scored again after the forward (prompt
logprobs).

Shapes: GQA 7:1 (28 q heads over 4 kv heads) on 2 and 4 ranks, one kv head copied to
both of 2 ranks with a tied head, a tied head with q/k/v bias (Qwen2), vocabularies not
divisible by the ranks. (4 ranks run one model: on a busy 2-core machine every collective
of 4 processes waits for a time slice; test_tp_layers covers copied kv heads on 4.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_hf_model, make_tiny_model
from tp_model_ranks import EXTRA, MAX_NEW, PROMPTS, SHARED, check, drive
from tp_util import run_ranks

from services.worker.parallel.group import TpGroup

GQA_7_1 = dict(
    hidden_size=112, num_attention_heads=28, num_key_value_heads=4, head_dim=4, vocab_size=301
)
MODELS = {
    "llama-gqa7": ("llama", GQA_7_1),
    "qwen2-tied-bias": ("qwen2", dict(vocab_size=301, num_hidden_layers=2)),
    "llama-kv-copied": (
        "llama",
        dict(num_key_value_heads=1, tie_word_embeddings=True, vocab_size=299),
    ),
}


def hf_reference(folder: Path, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' logits at the same positions, greedy continuations included."""
    hf = load_hf_model(folder)
    want: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        full = [
            hf(torch.tensor([p + t.tolist()])).logits[0]
            for p, t in zip(PROMPTS, tokens, strict=True)
        ]
        cached = hf(torch.tensor([PROMPTS[0][:SHARED] + EXTRA])).logits[0][SHARED:]
    want["prefill"] = torch.cat([f[: len(p)] for f, p in zip(full, PROMPTS, strict=True)])
    want["scored"] = want["prefill"].flip(0)[:5]
    for k in range(1, MAX_NEW):
        want[f"decode{k}"] = torch.stack(
            [f[len(p) + k - 1] for f, p in zip(full, PROMPTS, strict=True)]
        )
    greedy = [
        hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
        for p in PROMPTS
    ]
    want["tokens"] = torch.stack([g[0, len(p) :] for g, p in zip(greedy, PROMPTS, strict=True)])
    want["cached"] = cached
    return want


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, dict, dict]]:
    """Each model folder, transformers' reference and TP=1's own result."""
    out = {}
    for name, (arch, overrides) in MODELS.items():
        folder = make_tiny_model(tmp_path_factory.mktemp(name), arch, seed=3, **overrides)
        one = drive(TpGroup(), str(folder))
        assert one is not None
        out[name] = (folder, hf_reference(folder, one["tokens"]), one)
    return out


@pytest.mark.parametrize(
    "world,names",
    [(2, ["llama-gqa7", "qwen2-tied-bias", "llama-kv-copied"]), (4, ["llama-gqa7"])],
)
def test_tp_matches_transformers_and_tp1(models, world: int, names: list[str]) -> None:
    cases = [
        (str(models[n][0]), {"transformers": models[n][1], "tp1": models[n][2]}) for n in names
    ]
    run_ranks(check, world, cases)
