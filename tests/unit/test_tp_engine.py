"""The worker's ModelRunner as rank 0 of 2 (and 4) gloo ranks, driven by the real scheduler
(tests/tp_engine_ranks.py): greedy and seeded tokens equal TP=1's, logprobs and prompt
logprobs within 1e-4, through cache hits, chunked prefill, speculative verify steps and
retraction, with the pool whole afterwards; TP=1's greedy equals transformers'.

Shapes: GQA 7:1 (28 q heads over 4 kv heads), and Qwen2 with q/k/v bias, a tied head and
a vocabulary not divisible by 2.
"""

from __future__ import annotations

import pytest
import torch
from conftest import load_hf_model, make_tiny_model
from tp_engine_ranks import CASES, MAX_NEW, check, engine_outputs, workload
from tp_util import run_ranks

MODELS = {
    "llama-gqa7": (
        "llama",
        dict(hidden_size=112, num_attention_heads=28, num_key_value_heads=4, head_dim=4),
    ),
    "qwen2-tied-bias": ("qwen2", dict(vocab_size=301, num_hidden_layers=2)),
}


@pytest.mark.parametrize(
    "name,world", [("llama-gqa7", 2), ("qwen2-tied-bias", 2), ("llama-gqa7", 4)]
)
def test_tp_engine_equals_tp1(tmp_path, name: str, world: int) -> None:
    arch, overrides = MODELS[name]
    folder = make_tiny_model(tmp_path, arch, seed=5, **overrides)
    expected = {case: engine_outputs(str(folder), case) for case in CASES}
    rid, prompt, _ = workload()[0]
    hf = load_hf_model(folder)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
    assert expected["chunked"] is not None and expected["chunked"][rid]["tokens"] == ref
    run_ranks(check, world, str(folder), expected, timeout_s=180.0)
