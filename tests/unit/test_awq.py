"""AWQ int4 checkpoints (issue 14) against an independent packer (tests/awq_packer.py).

The packer quantizes a tiny random Llama (group 32) and Qwen2 (q/k/v bias, tied embedding,
group 64) and writes them as AWQ folders, plus float32 "twins" whose weights are exactly
the dequantized values. Then: radixserve's dequantized weights equal the packer's bit for
bit; its logits equal transformers' on the twin within 1e-4; greedy 32 tokens are equal,
with a cached prefix too. The loader's expectations are checked against the tensor layout
of the real Qwen2.5-7B-Instruct-AWQ checkpoint, written down below, and every
quantization_config it cannot serve is refused by name.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from awq_packer import (
    Quantized,
    awq_quantization_config,
    pack,
    quantize,
    set_quantization_config,
    write_awq_model,
)
from conftest import load_hf_model
from safetensors.torch import load_file, save_file
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

from kernels.awq_pack import dequantize, unpack
from services.worker.layers import AwqLinear, FusedLinear
from services.worker.model_loader import load_model, num_parameters, weight_nbytes
from services.worker.models import get_model_class
from services.worker.offline import generate
from services.worker.quant.awq import AwqConfig, parse_quantization_config

CPU = torch.device("cpu")


@dataclass
class AwqCase:
    folder: Path  # the AWQ checkpoint
    twin: Path  # float32, weights = the packer's dequantized values
    deq: dict[str, torch.Tensor]  # module name -> W [out, in] float32
    prompts: list[list[int]]
    expected: list[list[int]]  # transformers' greedy tokens on the twin


@pytest.fixture(scope="module", params=[("llama", 32), ("qwen2", 64)], ids=["llama", "qwen2"])
def awq_case(request, tmp_path_factory) -> AwqCase:
    arch, group = request.param
    src = request.getfixturevalue(f"tiny_{arch}_dir")
    dst = tmp_path_factory.mktemp(f"awq-{arch}") / "awq"
    folder, twin, deq = write_awq_model(src, dst, group)
    hf = load_hf_model(twin)
    prompts = make_prompts(8, hf.config.vocab_size)
    return AwqCase(folder, twin, deq, prompts, [hf_greedy(hf, p) for p in prompts])


# ---- the packer itself ----------------------------------------------------------------


def test_packer_nibble_order_is_awqs():
    """Columns 0..7 holding 1..8 pack as nibbles (low to high) 1 3 5 7 2 4 6 8."""
    word = pack(torch.arange(1, 9).view(1, 8))
    assert word.dtype == torch.int32 and word.shape == (1, 1)
    assert int(word) & 0xFFFFFFFF == 0x86427531
    assert torch.equal(unpack(word), torch.arange(1, 9, dtype=torch.int32).view(1, 8))


def test_packer_quantization_is_close():
    """Guards the tests below: 4-bit weights that still resemble the float ones."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    back = quantize(w, 32).dequantized()
    assert back.shape == w.shape
    assert 0 < (back - w).abs().max() < 0.2 * w.abs().max()


# ---- weights -------------------------------------------------------------------------


def test_dequantized_weights_equal_the_packers(awq_case, caplog):
    with caplog.at_level(logging.INFO, logger="services.worker.model_loader"):
        model, _ = load_model(str(awq_case.folder), torch.float32, CPU, progress=False)
    n = 4 * len(model.model.layers)
    assert f"AWQ: {n} linears dequantized to torch.float32 at load" in caplog.text  # the cost
    assert not any(isinstance(m, AwqLinear) for m in model.modules())
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        d = awq_case.deq
        qkv = torch.cat([d[p + f"self_attn.{x}_proj"] for x in "qkv"])
        gate_up = torch.cat([d[p + "mlp.gate_proj"], d[p + "mlp.up_proj"]])
        assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
        assert torch.equal(layer.self_attn.o_proj.weight, d[p + "self_attn.o_proj"])
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
        assert torch.equal(layer.mlp.down_proj.weight, d[p + "mlp.down_proj"])
        assert isinstance(layer.mlp.gate_up_proj, FusedLinear)
    twin = load_file(str(awq_case.twin / "model.safetensors"))
    if model.model.layers[0].self_attn.qkv_proj.bias is not None:  # qwen2: bias kept float
        ref = torch.cat([twin[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv"])
        assert torch.equal(model.model.layers[0].self_attn.qkv_proj.bias, ref)


def test_packed_model_keeps_int4_and_counts_it(awq_case):
    """dequantize=False (what CUDA does): packed buffers as in the file, counted by
    weight_nbytes (the KV pool sizing) and num_parameters; per-call dequant exact."""
    packed, _ = load_model(str(awq_case.folder), torch.float32, CPU, dequantize=False)
    dense, _ = load_model(str(awq_case.folder), torch.float32, CPU)
    awq = [m for m in packed.modules() if isinstance(m, AwqLinear)]
    assert len(awq) == 4 * len(packed.model.layers)
    ckpt = load_file(str(awq_case.folder / "model.safetensors"))
    down = packed.model.layers[0].mlp.down_proj
    assert isinstance(down, AwqLinear)
    assert torch.equal(down.qweight, ckpt["model.layers.0.mlp.down_proj.qweight"])
    assert num_parameters(packed) == num_parameters(dense)
    buffers = sum(b.nbytes for b in packed.buffers())
    assert buffers > 0 and weight_nbytes(packed) == buffers + sum(
        p.nbytes for p in packed.parameters()
    )
    assert weight_nbytes(packed) < weight_nbytes(dense)
    x = torch.randn(5, down.in_features)
    dense_down = dense.model.layers[0].mlp.down_proj
    assert torch.equal(down(x), dense_down(x))


# ---- logits and greedy tokens against transformers on the twin --------------------------


def test_logits_match_transformers(awq_case):
    hf, runner = load_hf_model(awq_case.twin), make_runner(awq_case.folder)
    assert runner.packed_linears > 0  # the dequantized weights run through oneDNN
    prompts = awq_case.prompts[:3]
    logits = logits_of(runner, prefill_batch(prompts, [0, 1, 2], [1, 200, 400]))
    rows = torch.split(logits, [len(p) for p in prompts])
    for p, got in zip(prompts, rows, strict=True):
        assert (got - hf_logits(hf, p)).abs().max().item() <= 1e-4


def test_greedy_matches_transformers(awq_case):
    runner = make_runner(awq_case.folder)
    assert generate(runner, awq_case.prompts, MAX_NEW) == awq_case.expected
    assert len({tuple(e) for e in awq_case.expected}) == len(awq_case.expected)


def test_greedy_with_cached_prefix_matches(awq_case):
    runner = make_runner(awq_case.folder)
    prompts = awq_case.prompts
    warm = [Job(i, p[: max(1, len(p) // 2)], first_slot=1 + 100 * i) for i, p in enumerate(prompts)]
    drive(runner, warm)
    jobs = [
        Job(8 + i, p, 2000 + 100 * i, prefix_slots=w.slots[: min(len(w.prompt), len(p) - 1)])
        for i, (p, w) in enumerate(zip(prompts, warm, strict=True))
    ]
    # Every request longer than one token starts on a cached prefix.
    assert [j.done_prompt > 0 for j in jobs] == [len(p) > 1 for p in prompts]
    assert drive(runner, jobs) == awq_case.expected


def test_modules_to_not_convert_loads_float(tiny_llama_dir, tmp_path):
    """A linear the checkpoint keeps float (here every down_proj) loads as float."""
    folder, twin, deq = write_awq_model(tiny_llama_dir, tmp_path / "awq", 32, ["down_proj"])
    assert "model.layers.0.mlp.down_proj" not in deq
    packed, _ = load_model(str(folder), torch.float32, CPU, dequantize=False)
    layer = packed.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, AwqLinear)
    assert not isinstance(layer.mlp.down_proj, AwqLinear)
    hf, runner = load_hf_model(twin), make_runner(folder)
    prompt = make_prompts(5, hf.config.vocab_size, seed=3)[4]
    logits = logits_of(runner, prefill_batch([prompt], [0], [1]))
    assert (logits - hf_logits(hf, prompt)).abs().max().item() <= 1e-4


# ---- refusals ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def awq_llama(tiny_llama_dir, tmp_path_factory) -> Path:
    return write_awq_model(tiny_llama_dir, tmp_path_factory.mktemp("awq-r") / "awq", 32)[0]


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(bits=8), r"bits 8 is not supported"),
        (dict(version="gemv"), r"version 'gemv' is not supported"),
        (dict(version="GEMV_fast"), r"version 'GEMV_fast'"),
        (dict(quant_method="gptq"), r"quant_method 'gptq' is not supported"),
        (dict(zero_point=False), r"zero_point false"),
        (dict(desc_act=True), r"key 'desc_act'"),
        (dict(group_size=0), r"group_size 0"),
        (dict(group_size=48), r"q_proj.*64 input features.*group_size 48"),
        (dict(modules_to_not_convert=["k_proj"]), r"modules_to_not_convert \['k_proj'\]"),
    ],
)
def test_unsupported_quantization_config_is_refused(awq_llama, tmp_path, changes, message):
    folder = shutil.copytree(awq_llama, tmp_path / "m")
    set_quantization_config(folder, **changes)
    with pytest.raises(ValueError, match=message):
        load_model(str(folder), torch.float32, CPU, progress=False)


def test_group_not_dividing_in_features_is_refused_per_module(awq_llama, tmp_path):
    """Each linear is checked: with 96 intermediate features, group 64 divides every input
    size but down_proj's."""
    folder = shutil.copytree(awq_llama, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96  # 96 % 64 != 0
    (folder / "config.json").write_text(json.dumps(cfg))
    set_quantization_config(folder, group_size=64)
    with pytest.raises(ValueError, match=r"down_proj has 96 input features.*group_size 64"):
        load_model(str(folder), torch.float32, CPU, progress=False)


def test_packed_tensor_of_the_wrong_dtype_is_named(awq_llama, tmp_path):
    folder = shutil.copytree(awq_llama, tmp_path / "m")
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.mlp.up_proj.qweight"
    tensors[name] = tensors[name].long()
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj\.qweight.*torch\.int64"):
        load_model(str(folder), torch.float32, CPU, progress=False)


def test_missing_scales_are_named(awq_llama, tmp_path):
    folder = shutil.copytree(awq_llama, tmp_path / "m")
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.0.self_attn.v_proj.scales"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"v_proj\.scales"):
        load_model(str(folder), torch.float32, CPU, progress=False)


def test_runtime_options_of_transformers_are_accepted():
    hub = awq_quantization_config(128) | {"version": "GEMM"}
    runtime = dict(backend="autoawq", do_fuse=False, fuse_max_seq_len=None)
    assert parse_quantization_config(hub | runtime) == AwqConfig(group_size=128)
    assert parse_quantization_config(None) is None


# ---- the layout of the real Qwen2.5-7B-Instruct-AWQ checkpoint --------------------------

# config.json of Qwen/Qwen2.5-7B-Instruct-AWQ (the fields that fix shapes).
QWEN25_7B_AWQ = dict(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    quantization_config={
        "bits": 4,
        "group_size": 128,
        "modules_to_not_convert": None,
        "quant_method": "awq",
        "version": "gemm",
        "zero_point": True,
    },
)
# Its safetensors header, layer 0 and the float tensors around the layers: (shape, dtype).
QWEN25_7B_AWQ_HEADER = {
    "self_attn.q_proj.qweight": ([3584, 448], "I32"),
    "self_attn.q_proj.qzeros": ([28, 448], "I32"),
    "self_attn.q_proj.scales": ([28, 3584], "F16"),
    "self_attn.q_proj.bias": ([3584], "F16"),
    "self_attn.k_proj.qweight": ([3584, 64], "I32"),
    "self_attn.k_proj.qzeros": ([28, 64], "I32"),
    "self_attn.k_proj.scales": ([28, 512], "F16"),
    "self_attn.k_proj.bias": ([512], "F16"),
    "self_attn.v_proj.qweight": ([3584, 64], "I32"),
    "self_attn.v_proj.qzeros": ([28, 64], "I32"),
    "self_attn.v_proj.scales": ([28, 512], "F16"),
    "self_attn.v_proj.bias": ([512], "F16"),
    "self_attn.o_proj.qweight": ([3584, 448], "I32"),
    "self_attn.o_proj.qzeros": ([28, 448], "I32"),
    "self_attn.o_proj.scales": ([28, 3584], "F16"),
    "mlp.gate_proj.qweight": ([3584, 2368], "I32"),
    "mlp.gate_proj.qzeros": ([28, 2368], "I32"),
    "mlp.gate_proj.scales": ([28, 18944], "F16"),
    "mlp.up_proj.qweight": ([3584, 2368], "I32"),
    "mlp.up_proj.qzeros": ([28, 2368], "I32"),
    "mlp.up_proj.scales": ([28, 18944], "F16"),
    "mlp.down_proj.qweight": ([18944, 448], "I32"),
    "mlp.down_proj.qzeros": ([148, 448], "I32"),
    "mlp.down_proj.scales": ([148, 3584], "F16"),
    "input_layernorm.weight": ([3584], "F16"),
    "post_attention_layernorm.weight": ([3584], "F16"),
}
QWEN25_7B_AWQ_OUTER = {
    "model.embed_tokens.weight": ([152064, 3584], "F16"),
    "model.norm.weight": ([3584], "F16"),
    "lm_head.weight": ([152064, 3584], "F16"),
}
_ST = {"I32": torch.int32, "F16": torch.float16}


def _qwen25_7b_awq_on_meta():
    config = transformers.Qwen2Config(**QWEN25_7B_AWQ)
    with torch.device("meta"):
        model = get_model_class("Qwen2ForCausalLM")(config).to(torch.float16)
        model.use_awq(parse_quantization_config(config.quantization_config))
    return model


def test_qwen25_7b_awq_layout():
    """The loader expects exactly the tensors, shapes and packed dtypes of the real file."""
    model = _qwen25_7b_awq_on_meta()
    expected = model.checkpoint_tensors()
    header = {
        f"model.layers.{i}.{k}": v for i in range(28) for k, v in QWEN25_7B_AWQ_HEADER.items()
    }
    header.update(QWEN25_7B_AWQ_OUTER)
    assert set(expected) == set(header)
    for name, (shape, st_dtype) in header.items():
        got_shape, got_dtype = expected[name]
        assert list(got_shape) == shape, name
        # Packed tensors must come in their own dtype; float ones convert to the compute dtype.
        packed = name.endswith((".qweight", ".qzeros", ".scales"))
        assert got_dtype == (_ST[st_dtype] if packed else None), name


def test_qwen25_7b_awq_leaves_a_24gb_gpu_to_the_kv_pool():
    """Weights as the GPU holds them (packed int4 + float16 rest): ~5.4 GiB, so at
    --mem-fraction-static 0.90 a 24 GiB GPU keeps > 15 GiB for the KV pool."""
    model = _qwen25_7b_awq_on_meta()
    total = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    assert 5.0 * 2**30 < total < 6.0 * 2**30
    assert 0.90 * 24 * 2**30 - total > 15 * 2**30
    assert 7.6e9 < num_parameters(model) < 7.7e9  # Qwen2.5-7B's 7.62 B, counted unpacked


def test_dequantize_matches_packer_on_random_words():
    """The unpacking alone, on arbitrary int32 words (every bit pattern, signs included)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (64, 24), generator=g)
    z = torch.randint(0, 16, (2, 24), generator=g)
    s = torch.rand(2, 24, generator=g).half()
    ref = Quantized(q, z, s).dequantized().t()  # [in, out]
    assert torch.equal(dequantize(pack(q), pack(z), s, 32), ref)
