"""Train radixserve's embedded default model: a tiny Llama that has memorised the Zen of Python.

`make run` serves this model so the server visibly works with no download. Everything it
learns from ships with Python itself (the standard library's `this` module), so the weights
may be committed. The defaults of every flag reproduce the committed model:

    .venv/bin/python scripts/train_default_model.py

It builds a byte-level BPE tokenizer (any text round-trips), a 4-layer Llama with grouped
query attention (so the server's GQA path is exercised), trains it on CPU for a few minutes,
saves everything with `save_pretrained`, and finally checks that greedy decoding completes
every line of the Zen from its first half.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]
IGNORE = -100  # label value the cross-entropy loss skips

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per message, then an open assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
SYSTEM_PROMPT = "You complete lines of the Zen of Python."
RECITE_PROMPT = "Recite the Zen of Python."
# A few canned turns so a first "hello" from a new user gets a sensible answer.
SMALL_TALK = [
    ("Hello!", "Hello! I complete lines of the Zen of Python. Give me the start of one."),
    ("Who are you?", "I am radixserve-zen, a tiny Llama model that knows the Zen of Python."),
]


@dataclass(frozen=True)
class Sample:
    """One training sequence; labels are IGNORE where the loss must not look (chat prompts)."""

    input_ids: list[int]
    labels: list[int]


def zen_text() -> str:
    """The Zen of Python, one line per "\\n"-terminated line.

    `import this` prints the Zen on first import; silence that, then decode the rot13 source
    string ourselves so the text never depends on stdout.
    """
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13").rstrip("\n") + "\n"


def zen_lines(text: str) -> list[str]:
    """The non-empty lines of the corpus, without their newline."""
    return [line for line in text.splitlines() if line]


def middle_split(line: str) -> tuple[str, str]:
    """Split at the space nearest the middle: (head, rest), rest keeps its leading space."""
    spaces = [i for i, ch in enumerate(line) if ch == " "]
    cut = min(spaces, key=lambda i: abs(i - len(line) / 2))
    return line[:cut], line[cut:]


def word_splits(line: str, around: int) -> list[tuple[str, str]]:
    """Splits at up to `around` spaces either side of the middle one."""
    spaces = [i for i, ch in enumerate(line) if ch == " "]
    mid = spaces.index(len(middle_split(line)[0]))
    chosen = spaces[max(0, mid - around) : mid + around + 1]
    return [(line[:cut], line[cut:]) for cut in chosen]


def build_tokenizer(corpus: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE: all 256 bytes are in the alphabet, so any UTF-8 text round-trips."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # keep " ." etc. exactly as generated
        model_max_length=512,
    )


def tokenizer_corpus(text: str) -> str:
    """Text the BPE merges are learnt from: the Zen plus the words of the chat scaffolding."""
    talk = [turn for pair in SMALL_TALK for turn in pair]
    chat = "\n".join(["system", "user", "assistant", SYSTEM_PROMPT, RECITE_PROMPT, *talk])
    return text + chat + "\n"


def raw_samples(tok: PreTrainedTokenizerFast, text: str) -> list[Sample]:
    """Plain-text completion: the whole text, every line alone, and runs of 2-4 lines.

    A line alone ends in "\\n" + EOS so a completion from position 0 stops after its line;
    runs of lines carry earlier lines as context, so mid-text prefixes also complete.
    """
    eos = [tok.eos_token_id]
    lines = text.splitlines()
    out = [_plain(tok(text)["input_ids"] + eos)]
    out += [_plain(tok(line + "\n")["input_ids"] + eos) for line in lines if line]
    for start in range(len(lines)):
        for size in (2, 3, 4):
            if start + size <= len(lines):
                out.append(_plain(tok("\n".join(lines[start : start + size]) + "\n")["input_ids"]))
    return out


def _plain(ids: list[int]) -> Sample:
    return Sample(ids, list(ids))


def chat_samples(tok: PreTrainedTokenizerFast, text: str) -> list[Sample]:
    """Chat turns: the user gives the head of a line, the assistant answers with the rest."""
    out = [_chat(tok, [{"role": "user", "content": RECITE_PROMPT}], text.rstrip("\n"))]
    out += [_chat(tok, [{"role": "user", "content": q}], a) for q, a in SMALL_TALK]
    for line in zen_lines(text):
        for head, rest in word_splits(line, around=2):
            user = [{"role": "user", "content": head}]
            system = [{"role": "system", "content": SYSTEM_PROMPT}]
            out.append(_chat(tok, user, rest.lstrip()))
            out.append(_chat(tok, system + user, rest.lstrip()))
    return out


def _chat(tok: PreTrainedTokenizerFast, messages: list[dict], answer: str) -> Sample:
    """Loss only on the assistant's answer and its <|im_end|>, not on the prompt."""
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template(
        messages + [{"role": "assistant", "content": answer}], tokenize=False
    )
    prompt_ids = tok(prompt)["input_ids"]
    ids = tok(full)["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids, "chat prompt must tokenize as a prefix"
    return Sample(ids, [IGNORE] * len(prompt_ids) + ids[len(prompt_ids) :])


def build_model(tok: PreTrainedTokenizerFast, args: argparse.Namespace) -> LlamaForCausalLM:
    """A small Llama; fewer KV heads than query heads (GQA), tied embeddings to save space."""
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads,
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    return LlamaForCausalLM(config)


def make_batch(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample; padding is masked out of attention and loss."""
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id)  # [B, T]
    labels = torch.full((len(samples), width), IGNORE)  # [B, T]
    mask = torch.zeros((len(samples), width), dtype=torch.long)  # [B, T]
    for row, s in enumerate(samples):
        ids[row, : len(s.input_ids)] = torch.tensor(s.input_ids)
        labels[row, : len(s.labels)] = torch.tensor(s.labels)
        mask[row, : len(s.input_ids)] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(
    model: LlamaForCausalLM, pool: list[Sample], pad_id: int, args: argparse.Namespace
) -> None:
    """AdamW over random batches drawn (with a seeded generator) from the sample pool."""
    gen = torch.Generator().manual_seed(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    model.train()
    start = time.monotonic()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        picks = torch.randint(len(pool), (args.batch_size,), generator=gen).tolist()
        loss = model(**make_batch([pool[i] for i in picks], pad_id)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            elapsed = time.monotonic() - start
            print(
                f"step {step:4d}/{args.steps}  loss {loss.item():.4f}  {elapsed:6.1f}s", flush=True
            )
    model.eval()


@torch.no_grad()
def greedy(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, prompt: str, n: int) -> str:
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def check_completions(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, text: str) -> int:
    """Greedy-complete every line from its first half; print and count the misses."""
    misses = 0
    for line in zen_lines(text):
        head, rest = middle_split(line)
        got = greedy(model, tok, head, n=len(tok(rest)["input_ids"]) + 2)
        if not got.startswith(rest):
            misses += 1
            print(f"MISS {head!r} -> {got!r} (want {rest!r})")
    print(f"greedy completion: {len(zen_lines(text)) - misses}/{len(zen_lines(text))} lines")
    return misses


def save(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: Path) -> None:
    """Weights as safetensors; the chat template inline in tokenizer_config.json."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out, save_jinja_files=False)
    _portable_tokenizer_class(out / "tokenizer_config.json")
    eos_ids = [tok.eos_token_id, tok.convert_tokens_to_ids(IM_END)]
    # <|im_end|> is a second EOS so chat turns stop at the end of the assistant's answer.
    GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=tok.pad_token_id, do_sample=False
    ).save_pretrained(out)


def _portable_tokenizer_class(path: Path) -> None:
    """Name the class every transformers release knows; v5's own name is "TokenizersBackend"."""
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def parse_args() -> argparse.Namespace:
    here = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=here / "services" / "common" / "default_model" / "radixserve-zen",
    )
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    # One thread: the same sums in the same order on any machine (bit-for-bit reproducible),
    # and on a shared, busy CPU it ran ~7x faster than two spinning threads.
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads; results depend on it")
    p.add_argument(
        "--vocab-size", type=int, default=768, help="BPE target; the tiny corpus may stop short"
    )
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    text = zen_text()
    tok = build_tokenizer(tokenizer_corpus(text), args.vocab_size)
    raw, chat = raw_samples(tok, text), chat_samples(tok, text)
    # Weighting by repetition: the whole text and single lines matter most for completion.
    pool = raw[:1] * 8 + raw[1:] * 2 + chat
    model = build_model(tok, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab {len(tok)}  params {n_params:,}  samples raw {len(raw)} chat {len(chat)}")
    start = time.monotonic()
    train(model, pool, tok.pad_token_id, args)
    print(f"trained in {time.monotonic() - start:.1f}s")
    misses = check_completions(model, tok, text)
    save(model, tok, args.out_dir)
    print(f"saved to {args.out_dir}")
    if misses:
        raise SystemExit(f"{misses} lines not completed; train longer (--steps)")


if __name__ == "__main__":
    main()
