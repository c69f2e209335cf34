"""radixserve's worker in bfloat16 on the CPU against transformers (issue 42).

The tolerance is transformers' own: its CPU bfloat16 forward (the default sdpa attention)
against its float32 forward on the same weights. Measure: the share of greedy tokens
before each sequence's first divergence. On the tiny random models of tests/conftest.py
(flat logits, where bfloat16 rounding flips many argmaxes) transformers' bfloat16 agrees
with its float32 for 0.556 of the tokens (llama, qwen2 and qwen3 pooled, 8 prompts x 32
tokens each; 0.59 over 12 such models, seeds 0-2), radixserve's bfloat16 with
transformers' bfloat16 for 0.691 (0.73), and with float32 for 0.523 (0.62): radixserve in
bfloat16 is nearer transformers' bfloat16 than that is to its own float32. Its logits are
as far from float32 as transformers' bfloat16 ones (within 1.5x of their largest
difference). On the trained default model no greedy token of the Zen lines changes in
bfloat16 (transformers' nor radixserve's; the AVX2 build's neither). Against itself
radixserve is token-exact in bfloat16 across batch composition, cache hits and chunked
prefill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import load_hf_model, make_tiny_model
from test_default_model import first_half, zen_lines
from test_model_parity import (
    MAX_NEW,
    Job,
    drive,
    hf_greedy,
    hf_logits,
    logits_of,
    make_prompts,
    make_runner,
    prefill_batch,
)

from services.common.config import DEFAULT_MODEL_PATH
from services.worker.cpu_linear import onednn_bf16_available
from services.worker.layers import Linear
from services.worker.model_loader import resolve_dtype
from services.worker.offline import generate

BF16 = torch.bfloat16
ARCHS = ["llama", "qwen2", "qwen3"]
REPO = Path(__file__).resolve().parents[2]


def _cc_flags() -> str:
    from kernels.cpu import _cc

    return _cc.cpu_flags() if _cc.compiler() is not None and not _cc.disabled() else ""


def hf_bf16(folder) -> torch.nn.Module:
    """transformers' CPU bfloat16 forward as it comes (sdpa attention)."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=BF16).eval()


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """The share of tokens before each sequence's first divergence, over all sequences."""
    same = 0
    for a, b in zip(got, want, strict=True):
        n = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        same += n
    return same / sum(len(b) for b in want)


@pytest.fixture(scope="module")
def cases(request) -> dict:
    """Per arch: folder, prompts, and the greedy tokens of transformers float32 / bfloat16
    and of radixserve bfloat16."""
    out = {}
    for arch in ARCHS:
        folder = request.getfixturevalue(f"tiny_{arch}_dir")
        hf32, hf16 = load_hf_model(folder), hf_bf16(folder)
        prompts = make_prompts(8, hf32.config.vocab_size)
        runner = make_runner(folder, dtype="bfloat16")
        out[arch] = dict(
            folder=folder,
            prompts=prompts,
            hf32=[hf_greedy(hf32, p) for p in prompts],
            hf16=[hf_greedy(hf16, p) for p in prompts],
            rs16=generate(runner, prompts, MAX_NEW),
            models=(hf32, hf16),
        )
    return out


def test_greedy_tokens_within_transformers_own_bf16_tolerance(cases):
    pooled = {k: [s for c in cases.values() for s in c[k]] for k in ("hf32", "hf16", "rs16")}
    own = agreement(pooled["hf16"], pooled["hf32"])  # transformers bf16 vs its float32
    ours = agreement(pooled["rs16"], pooled["hf16"])
    assert 0.3 < own < 1.0  # the bf16 rounding does flip tokens of these flat models
    assert ours >= own, (ours, own)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_as_close_to_float32_as_transformers_bf16(cases, arch):
    case = cases[arch]
    hf32, hf16 = case["models"]
    runner = make_runner(case["folder"], dtype="bfloat16")
    prompts = case["prompts"][:3]
    logits = logits_of(runner, prefill_batch(prompts, [0, 1, 2], [1, 200, 400]))
    for p, got in zip(prompts, torch.split(logits, [len(p) for p in prompts]), strict=True):
        ref = hf_logits(hf32, p)
        theirs = (hf_logits(hf16, p).float() - ref).abs().max().item()
        assert (got - ref).abs().max().item() <= 1.5 * theirs + 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_is_token_exact_against_itself(cases, arch):
    """Alone or batched, on a cached prefix, prefilled in chunks: the same tokens."""
    case = cases[arch]
    runner = make_runner(case["folder"], dtype="bfloat16")
    prompts, expected = case["prompts"], case["rs16"]
    assert [generate(runner, [p], MAX_NEW)[0] for p in prompts] == expected
    warm = [Job(i, p[: max(1, len(p) // 2)], first_slot=1 + 100 * i) for i, p in enumerate(prompts)]
    drive(runner, warm)
    jobs = [
        Job(
            8 + i,
            p,
            first_slot=2000 + 100 * i,
            prefix_slots=w.slots[: min(len(w.prompt), len(p) - 1)],
        )
        for i, (p, w) in enumerate(zip(prompts, warm, strict=True))
    ]
    assert drive(runner, jobs) == expected
    chunked = [Job(i, p, first_slot=1 + 100 * i) for i, p in enumerate(prompts)]
    assert drive(runner, chunked, chunk=5) == expected


def test_default_model_greedy_in_bf16_equals_float32():
    """The trained default model: radixserve in bfloat16 changes no greedy token of the Zen
    lines against transformers in float32 (nor does transformers' bfloat16: measured on all
    20 lines, 24 tokens each)."""
    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    prompts = [tok(first_half(line)[0])["input_ids"] for line in zen_lines()[1::2]]
    hf32 = load_hf_model(DEFAULT_MODEL_PATH)
    want = [hf_greedy(hf32, p, 16) for p in prompts]
    runner = make_runner(DEFAULT_MODEL_PATH, dtype="bfloat16")
    assert generate(runner, prompts, 16) == want


# ---- --dtype auto ----------------------------------------------------------------------


def test_auto_serves_a_bf16_checkpoint_in_bf16_on_cpu(tiny_llama_dir, tmp_path):
    """config.json's dtype decides on CPU too: the packed linears, the small-M kernel and
    the KV pool all in bfloat16; float32 checkpoints stay float32."""
    folder = tmp_path / "bf16"
    load_hf_model(tiny_llama_dir).to(BF16).save_pretrained(folder)
    runner = make_runner(folder, dtype="auto")
    assert runner.dtype == BF16 and runner.kv_pool.k[0].dtype == BF16
    assert runner.info().dtype == "bfloat16"
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert runner.packed_linears == len(linears)
    path = "onednn-bf16" if onednn_bf16_available() else "linear"
    assert all(m.packed.path == path and m.packed.kernel_rows > 0 for m in linears)
    assert make_runner(tiny_llama_dir, dtype="auto").dtype == torch.float32


@pytest.mark.parametrize(
    "declared,device,want",
    [
        ("bfloat16", "cpu", BF16),
        ("float16", "cpu", torch.float16),
        ("float32", "cpu", torch.float32),
        (None, "cpu", torch.float32),
        ("float32", "cuda", BF16),
        (None, "cuda", BF16),
        ("float16", "cuda", torch.float16),
        ("torch.bfloat16", "cpu", BF16),
    ],
)
def test_resolve_dtype_auto(declared, device, want):
    config = transformers.LlamaConfig()
    config.dtype = declared
    assert resolve_dtype("auto", config, torch.device(device)) == want
    assert resolve_dtype("float32", config, torch.device(device)) == torch.float32


def test_a_float16_runner_uses_the_16_bit_kernels(tmp_path):
    """float16 on CPU: the small-M kernel and the element-wise passes, attention on torch."""
    folder = make_tiny_model(tmp_path / "f16", "llama")
    runner = make_runner(folder, dtype="float16")
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None and m.packed.kernel_rows > 0 for m in linears)
    out = generate(runner, make_prompts(2, 300), 8)
    assert all(len(o) == 8 for o in out)


def test_a_large_bf16_tied_head_runs_on_the_dense_table(tiny_qwen2_dir, monkeypatch):
    """Past TIED_HEAD_COPY_MAX_BYTES a bfloat16 tied head has no copy either: the 16-bit
    kernel on the dense table for few rows, oneDNN (or F.linear) over it for more."""
    from kernels.cpu import gemm as cpu_gemm
    from services.worker.models import llama

    monkeypatch.setattr(llama, "TIED_HEAD_COPY_MAX_BYTES", 0)
    model = make_runner(tiny_qwen2_dir, dtype="bfloat16").model
    assert model.tied_head is not None and not hasattr(model.tied_head, "path")
    table = model.model.embed_tokens.weight
    for rows in (1, 3, llama.TIED_HEAD_KERNEL_ROWS + 5):
        x = torch.randn(rows, table.shape[1]).to(BF16)
        got = model.compute_logits(x)
        assert got.dtype == torch.float32
        ref = cpu_gemm.gemm16_ref(x, table)
        assert (got.double() - ref).abs().max() <= 2**-7 * ref.abs().max()


_AVX2_RUN = """
import json, sys
from kernels.cpu import gemm as cpu_gemm, extend_attention as cpu_extend_attention
from services.common.config import WorkerConfig
from services.worker.model_runner import ModelRunner
from services.worker.offline import generate
assert cpu_gemm.isa16() == 1 and cpu_extend_attention.load() is not None
cfg = WorkerConfig(model_path=sys.argv[1], device="cpu", dtype="bfloat16",
                   max_total_tokens=4096, max_running_requests=16)
print(json.dumps(generate(ModelRunner(cfg), json.loads(sys.argv[2]), 16)))
"""


@pytest.mark.skipif(" avx512f " not in f" {_cc_flags()} ", reason="native is AVX2 or less here")
def test_the_avx2_build_serves_the_whole_bf16_forward():
    """RADIXSERVE_CPU_ISA=avx2 (a process whose kernels are all built without AVX-512):
    the default model's bfloat16 greedy tokens still equal transformers' float32 ones."""
    tok = transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)
    prompts = [tok(first_half(line)[0])["input_ids"] for line in zen_lines()[::4]]
    hf32 = load_hf_model(DEFAULT_MODEL_PATH)
    want = [hf_greedy(hf32, p, 16) for p in prompts]
    env = {**os.environ, "RADIXSERVE_CPU_ISA": "avx2"}
    args = [sys.executable, "-c", _AVX2_RUN, DEFAULT_MODEL_PATH, json.dumps(prompts)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == want
