"""Shared fixtures: tiny random-weight HF models saved with save_pretrained (safetensors).

Built with transformers' own classes, so radixserve's loader and model are tested against
the real thing. Session-scoped: each model is built once per test run.

    make_tiny_model(folder, "llama", num_hidden_layers=3) -> folder   (any config override)
    make_tiny_zen_model(folder, seed=3) -> folder   (a tiny Llama over the default tokenizer)
    fixtures: tiny_llama_dir, tiny_qwen2_dir, tiny_mistral_dir, tiny_qwen3_dir
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from services.common.config import DEFAULT_MODEL_PATH

# Small, but with every feature the worker must get right: GQA (4 query heads share 2 KV
# heads), several layers, a vocabulary large enough to make argmax ties unlikely.
_BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

TINY_ARCHS = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=False, rope_theta=10000.0),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=True, num_hidden_layers=3, initializer_range=0.15),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(tie_word_embeddings=False, sliding_window=None),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(tie_word_embeddings=True, head_dim=32, initializer_range=0.15),
    ),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0; random values make those paths count."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def make_tiny_model(folder: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Builds a random-weight HF model of ``arch`` and saves it (config, safetensors,
    generation_config) into ``folder``. Returns the folder."""
    config_cls, model_cls, arch_defaults = TINY_ARCHS[arch]
    kwargs = {**_BASE, **arch_defaults, **overrides}
    rope_theta = kwargs.pop("rope_theta", None)
    config = config_cls(**kwargs)
    if rope_theta is not None and getattr(config, "rope_parameters", None):
        config.rope_parameters["rope_theta"] = rope_theta
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _randomise(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# The default model's tokenizer (services/common/default_model): its vocabulary, and the
# files that make a tiny model's folder take text prompts.
ZEN_VOCAB = 596
_ZEN_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_tiny_zen_model(folder: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random Llama over the default model's tokenizer (its vocabulary, EOS and pad
    0, no BOS), the tokenizer files copied beside the weights, so text prompts work."""
    fields = dict(vocab_size=ZEN_VOCAB, eos_token_id=0, pad_token_id=0, bos_token_id=None)
    make_tiny_model(folder, "llama", seed=seed, **{**fields, **overrides})
    for name in _ZEN_TOKENIZER_FILES:
        shutil.copy(Path(DEFAULT_MODEL_PATH) / name, folder / name)
    return folder


def load_hf_model(folder: Path) -> torch.nn.Module:
    """The transformers reference model of a saved folder, float32, eager attention."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral"), "mistral")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")
