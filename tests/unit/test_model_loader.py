"""Loading HF folders (errors name the culprit; shards; dtypes) and the runner's contract
(WorkerInfo, pool sizing, malformed batches)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import load_hf_model
from safetensors.torch import load_file, save_file

from radixserve.internal.v1 import engine_pb2
from services.common.config import WorkerConfig
from services.common.transport import pack_i32
from services.worker import wire
from services.worker.model_loader import load_model
from services.worker.model_runner import ModelRunner

CPU = torch.device("cpu")


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite_weights(folder, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def test_unknown_architecture_is_named(tiny_llama_dir, tmp_path):
    folder = copy_model(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPTFooForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPTFooForCausalLM"):
        load_model(str(folder), torch.float32, CPU)


def test_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    folder = copy_model(tiny_llama_dir, tmp_path / "m")
    rewrite_weights(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(str(folder), torch.float32, CPU)


def test_shape_mismatch_is_named(tiny_llama_dir, tmp_path):
    folder = copy_model(tiny_llama_dir, tmp_path / "m")

    def shrink(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:-1].clone()

    rewrite_weights(folder, shrink)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(127, 64\)"):
        load_model(str(folder), torch.float32, CPU)


def test_sharded_checkpoint_loads(tiny_llama_dir, tmp_path):
    hf = load_hf_model(tiny_llama_dir)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    model, _ = load_model(str(tmp_path / "sharded"), torch.float32, CPU, progress=False)
    ref, _ = load_model(str(tiny_llama_dir), torch.float32, CPU, progress=False)
    for (name, a), (_, b) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_tied_embeddings_and_bf16(tiny_qwen2_dir):
    model, _ = load_model(str(tiny_qwen2_dir), torch.bfloat16, CPU, progress=False)
    assert model.lm_head is None
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    hidden = torch.randn(2, 64, dtype=torch.bfloat16)
    assert model.compute_logits(hidden).dtype == torch.float32


# ---- the runner -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def runner(tiny_qwen2_dir) -> ModelRunner:
    return ModelRunner(
        WorkerConfig(
            model_path=str(tiny_qwen2_dir),
            device="cpu",
            max_total_tokens=1000,
            max_running_requests=4,
        )
    )


def test_info_is_filled(runner):
    info = runner.info()
    assert info.architecture == "Qwen2ForCausalLM"
    assert (info.vocab_size, info.max_model_len, info.max_total_num_tokens) == (300, 512, 1000)
    assert (
        info.num_layers,
        info.hidden_size,
        info.num_attention_heads,
        info.num_key_value_heads,
    ) == (3, 64, 4, 2)
    assert (info.head_dim, info.intermediate_size, info.max_running_requests) == (16, 128, 4)
    assert (info.device, info.dtype, info.attention_backend) == ("cpu", "float32", "torch")
    assert list(info.eos_token_ids) == [2]
    assert info.num_parameters == sum(p.numel() for p in runner.model.parameters()) > 0
    assert runner.kv_pool.k[0].shape == (1001, 2, 16)


def test_pool_from_memory_fraction_is_capped(tiny_llama_dir):
    r = ModelRunner(
        WorkerConfig(
            model_path=str(tiny_llama_dir), device="cpu", max_running_requests=2, context_length=128
        )
    )
    # 0.3 of RAM would hold millions of tiny-model tokens; the cap is every row full.
    assert r.info().max_total_num_tokens == 2 * 128
    assert r.info().max_model_len == 128


def _req(**kw) -> engine_pb2.ForwardRequest:
    base = dict(
        req_slot=0,
        input_ids=pack_i32([5, 6]),
        prefix_len=0,
        out_slots=pack_i32([1, 2]),
        is_new=True,
        sample=True,
    )
    return engine_pb2.ForwardRequest(**{**base, **kw})


@pytest.mark.parametrize(
    "req, message",
    [
        (_req(req_slot=4), "req_slot out of range"),
        (_req(out_slots=pack_i32([1])), "1 out_slots for 2 input_ids"),
        (_req(out_slots=pack_i32([1, 1001])), "KV slot out of range"),
        (_req(out_slots=pack_i32([0, 1])), "KV slot out of range"),
        (_req(prefix_len=3, prefix_slots=pack_i32([1])), "1 prefix_slots for prefix_len 3"),
        (_req(input_ids=pack_i32([5, 300])), "out of the vocabulary"),
        (_req(prefix_len=511, prefix_slots=pack_i32(range(3, 514))), "exceeds the context length"),
        (_req(req_slot=3, is_new=False), "never started"),
    ],
)
def test_malformed_batch_is_rejected(runner, req, message):
    with pytest.raises(ValueError, match=message):
        wire.forward(runner, engine_pb2.ForwardBatch(reqs=[req]))


def test_decode_batch_needs_one_token_each(runner):
    wire.forward(runner, engine_pb2.ForwardBatch(reqs=[_req()]))
    bad = _req(is_new=False, prefix_len=2, out_slots=pack_i32([3, 4]))
    with pytest.raises(ValueError, match="1 token per request"):
        wire.forward(runner, engine_pb2.ForwardBatch(is_decode=True, reqs=[bad]))


def test_unsampled_chunk_returns_minus_one(runner):
    result = wire.forward(
        runner, engine_pb2.ForwardBatch(batch_id=7, reqs=[_req(req_slot=1, sample=False)])
    )
    assert result.batch_id == 7 and [t.token_id for t in result.tokens] == [-1]
    assert result.forward_time > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_runner_generates(tiny_llama_dir, dtype):
    from services.worker.offline import generate

    r = ModelRunner(
        WorkerConfig(
            model_path=str(tiny_llama_dir),
            device="cpu",
            dtype=dtype,
            max_total_tokens=256,
            max_running_requests=2,
        )
    )
    assert r.info().dtype == dtype and r.kv_pool.k[0].dtype == getattr(torch, dtype)
    out = generate(r, [[5, 6, 7], [9, 10, 11, 12, 13]], 6, stop_at_eos=False)
    assert [len(o) for o in out] == [6, 6] and all(0 <= t < 300 for o in out for t in o)


def test_the_weights_fingerprint_tells_checkpoints_of_one_layout_apart(tmp_path):
    """Two random checkpoints of one config share every header byte; their sampled data
    differs. A copy of one checkpoint keeps its fingerprint."""
    import shutil

    from safetensors.torch import save_file

    from services.worker.model_loader import weights_fingerprint

    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        folder = tmp_path / f"m{seed}"
        folder.mkdir()
        save_file({"w": torch.randn(256, 256), "b": torch.randn(256)}, folder / "model.safetensors")
        paths.append(folder / "model.safetensors")
    copy = tmp_path / "copy" / "model.safetensors"
    copy.parent.mkdir()
    shutil.copy(paths[0], copy)
    a, b, c = (weights_fingerprint([p]) for p in (*paths, copy))
    assert a != b and a == c and len(a) == 16
