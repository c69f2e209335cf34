"""The embedded default model (models/radixserve-zen) that `make run` serves with no download.

Only transformers is used here, so these checks hold whatever the serving stack does: the
model must have memorised the Zen of Python well enough that greedy decoding finishes any
line from its first half, and its tokenizer must round-trip any text.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.config import DEFAULT_MODEL_PATH

MODEL_DIR = Path(DEFAULT_MODEL_PATH)
MAX_WEIGHTS_BYTES = 8 * 1024 * 1024


def zen_lines() -> list[str]:
    """Non-empty lines of the Zen; `import this` prints, so silence it and decode ourselves."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return [line for line in codecs.decode(this.s, "rot13").splitlines() if line]


def first_half(line: str) -> tuple[str, str]:
    """Split at the space nearest the middle: (prompt, rest); rest keeps its leading space."""
    spaces = [i for i, ch in enumerate(line) if ch == " "]
    cut = min(spaces, key=lambda i: abs(i - len(line) / 2))
    return line[:cut], line[cut:]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    return model.eval()


def greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=False)


def test_greedy_completes_every_line_from_its_first_half(model, tokenizer):
    lines = zen_lines()
    assert len(lines) == 20  # title + 19 aphorisms: the corpus is what we think it is
    misses = []
    for line in lines:
        prompt, rest = first_half(line)
        budget = len(tokenizer(rest)["input_ids"]) + 1
        got = greedy(model, tokenizer, prompt, budget)
        if not got.startswith(rest):
            misses.append((prompt, rest, got))
    assert not misses, misses


def test_chat_template_renders_chatml_and_chat_completes(model, tokenizer):
    messages = [{"role": "user", "content": "Errors should never"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nErrors should never<|im_end|>\n<|im_start|>assistant\n"
    closed = tokenizer.apply_chat_template(messages, tokenize=False)
    assert closed == "<|im_start|>user\nErrors should never<|im_end|>\n"
    # generation_config lists <|im_end|> as an EOS, so the answer stops right after it.
    assert greedy(model, tokenizer, prompt, 16) == "pass silently.<|im_end|>"


def test_special_tokens_are_single_ids_and_stop_generation(model, tokenizer):
    ids = {
        t: tokenizer.convert_tokens_to_ids(t)
        for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    }
    assert len(set(ids.values())) == 3 and tokenizer.unk_token_id not in ids.values()
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer("<|im_start|>")["input_ids"] == [ids["<|im_start|>"]]
    assert model.config.eos_token_id == ids["<|endoftext|>"]
    assert model.generation_config.eos_token_id == [ids["<|endoftext|>"], ids["<|im_end|>"]]


@pytest.mark.parametrize("text", ["héllo 世界 🙂", "  tabs\tand\nnewlines \r\n", "\x00\x7f€ z̧", ""])
def test_tokenizer_round_trips_any_text(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


def test_weights_are_small_and_config_is_gqa_llama(model, tokenizer):
    weights = MODEL_DIR / "model.safetensors"
    assert 0 < weights.stat().st_size <= MAX_WEIGHTS_BYTES
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["vocab_size"] == len(tokenizer)
    assert model.config.tie_word_embeddings
    assert all(p.dtype == torch.float32 for p in model.parameters())
