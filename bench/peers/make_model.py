"""Builds the peer benchmark's models: transformers' own classes, random weights, safetensors.

No model can be downloaded here, and a benchmark of serving speed needs the shapes of a
real model, not its knowledge: so the weights are random (seeded) and the tokenizer is
the default model's (services.common.config.DEFAULT_MODEL_PATH), with its length limit
raised to the model's. Both servers load the same folder, so both see the same tokens.

Random weights would also emit special tokens and lone UTF-8 byte tokens, which decode to
no text: a streaming server then holds its output back (radixserve until the bytes form a
character, vLLM sends empty chunks), and the client could not time tokens. Their rows of
the (tied) embedding are zeroed, so their logits are 0 while the best of the ~470 others
is positive: greedy decoding never picks them, and prompts (plain words) never hold them.

- "small": float32 Llama, hidden 512, 8 layers, 8 query / 4 KV heads, MLP 1,408: ~24M
  parameters, 4,096 positions.
- "qwen-0.5b": float32, Qwen2-0.5B's shape (hidden 896, 24 layers, 14 query / 2 KV heads,
  MLP 4,864, q/k/v bias) with the small vocabulary of the default tokenizer, so ~0.36B
  parameters instead of 0.49B (the 136M of Qwen's vocabulary rows are mostly untouched by
  a forward pass anyway, except the LM head).

Models go under $RADIXSERVE_PEERS_DIR/models (default ~/.cache/radixserve-peers/models),
outside the repository.

    .venv/bin/python bench/peers/make_model.py small qwen-0.5b [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from services.common.config import DEFAULT_MODEL_PATH  # noqa: E402

PEERS_DIR = Path(
    os.environ.get("RADIXSERVE_PEERS_DIR", Path.home() / ".cache" / "radixserve-peers")
)
MODELS_DIR = PEERS_DIR / "models"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_POSITIONS = 4096
LONG_POSITIONS = 32768  # "small-32k": the context curves (issue 42) reach 32k tokens

SHAPES: dict[str, dict] = {
    "small": dict(
        arch="llama",
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1408,
        tie_word_embeddings=True,
    ),
    "qwen-0.5b": dict(
        arch="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
    ),
}

SHAPES["small-32k"] = {**SHAPES["small"], "max_position_embeddings": LONG_POSITIONS}


def model_dir(name: str) -> Path:
    return MODELS_DIR / name


def copy_tokenizer(dst: Path, positions: int = MAX_POSITIONS) -> int:
    """The default model's tokenizer files, limit raised to the model's; returns its length."""
    from transformers import AutoTokenizer

    src = Path(DEFAULT_MODEL_PATH)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    cfg_path = dst / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["model_max_length"] = positions
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return len(AutoTokenizer.from_pretrained(dst))


def build_config(name: str, vocab: int, eos: int):
    import transformers

    shape = {"max_position_embeddings": MAX_POSITIONS, **SHAPES[name]}
    arch = shape.pop("arch")
    cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    return cls(
        vocab_size=vocab,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype="float32",
        **shape,
    )


def silent_tokens(tokenizer) -> list[int]:
    """Tokens that decode to no text on their own: special tokens and partial UTF-8 bytes."""
    special = set(tokenizer.all_special_ids)
    return [t for t in range(len(tokenizer)) if t in special or _silent(tokenizer.decode([t]))]


def _silent(text: str) -> bool:
    return not text or "\ufffd" in text


def make(name: str, force: bool = False) -> Path:
    """Builds model `name` unless its folder already holds one; returns the folder."""
    import torch
    import transformers

    out = model_dir(name)
    if (out / "config.json").exists() and not force:
        return out
    out.mkdir(parents=True, exist_ok=True)
    vocab = copy_tokenizer(out, SHAPES[name].get("max_position_embeddings", MAX_POSITIONS))
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    torch.manual_seed(0)
    config = build_config(name, vocab, tokenizer.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight[silent_tokens(tokenizer)] = 0.0
    model.save_pretrained(out)  # safetensors
    params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {params / 1e6:.1f}M parameters -> {out}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("names", nargs="+", choices=sorted(SHAPES))
    ap.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    ns = ap.parse_args()
    for name in ns.names:
        print(make(name, ns.force))


if __name__ == "__main__":
    main()
