"""A whole model through the ``triton`` attention backend gives the ``torch`` backend's tokens,
and the CUDA-graph runner's padded static buffers give the logits of an eager forward.

Without CUDA the Triton kernels run in the interpreter, so the model is tiny and the runs short.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from services.common.config import WorkerConfig  # noqa: E402
from services.worker.attention.base import AttentionMeta  # noqa: E402
from services.worker.cuda_graph import CudaGraphRunner, capture_sizes  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.offline import generate  # noqa: E402
from services.worker.req_table import ReqToTokenTable  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11], [8, 8, 8, 8, 8, 8, 8, 60, 61]]


def _greedy(model_dir, backend: str) -> list[list[int]]:
    cfg = WorkerConfig(
        model_path=str(model_dir),
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        max_total_tokens=256,
        max_running_requests=4,
        context_length=64,
        disable_cuda_graph=True,
    )
    runner = ModelRunner(cfg)
    assert runner.backend_name == backend
    return generate(runner, PROMPTS, max_new_tokens=6, stop_at_eos=False)


@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen3_dir"])  # head dims 16 and 32
def test_triton_backend_greedy_tokens_equal_torch_backend(arch_dir, request):
    model_dir = request.getfixturevalue(arch_dir)
    want = _greedy(model_dir, "torch")
    assert [len(t) for t in want] == [6, 6, 6]
    assert _greedy(model_dir, "triton") == want


class EagerGraphRunner(CudaGraphRunner):
    """CudaGraphRunner's static buffers and padding, with each graph replaced by an eager
    forward over the same buffers: what a replay computes, checkable without a GPU."""

    def _capture_all(self, device: torch.device) -> None:
        pass

    def _launch(self, bs: int) -> torch.Tensor:
        return self._run(bs, self._static_meta(bs))


def test_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]


def _decode_meta(table: ReqToTokenTable, rows: list[tuple[int, int, int]]) -> AttentionMeta:
    """Decode metadata for requests given as (table row, first slot, context length): each
    context in contiguous slots, written into its row of the table."""
    for row, base, n in rows:
        table.write_prefix(row, torch.arange(base, base + n))
    seq_lens = torch.tensor([n for _, _, n in rows], dtype=torch.int32)
    return AttentionMeta(
        is_decode=True,
        out_slots=torch.tensor([base + n - 1 for _, base, n in rows]),
        qo_indptr=torch.arange(len(rows) + 1, dtype=torch.int32),
        req_to_token=table.table,
        req_slots=torch.tensor([row for row, _, _ in rows], dtype=torch.int32),
        prefix_lens=seq_lens - 1,
        extend_lens=torch.ones(len(rows), dtype=torch.int32),
        seq_lens=seq_lens,
        max_seq_len=int(seq_lens.max()),
        max_extend_len=1,
    )


def test_graph_runner_pads_batches_and_returns_the_eager_logits(tiny_llama_dir):
    cfg = WorkerConfig(
        model_path=str(tiny_llama_dir),
        device="cpu",
        dtype="float32",
        attention_backend="triton",
        max_total_tokens=256,
        max_running_requests=4,
        context_length=64,
    )
    runner = ModelRunner(cfg)
    model = runner.model
    # Fill the pool: offline.generate gives request i the slots base_i + 1 .. (see its docstring),
    # and after 2 new tokens the KV of prompt + first token is stored.
    outputs = generate(runner, PROMPTS, max_new_tokens=2, stop_at_eos=False)
    spans = [len(p) + 2 for p in PROMPTS]
    bases = [1 + sum(spans[:i]) for i in range(len(PROMPTS))]
    table = ReqToTokenTable(4, 64, torch.device("cpu"))
    graphs = EagerGraphRunner(model, max_bs=4, table=table, device=torch.device("cpu"))
    assert graphs.sizes == [1, 2, 4] and graphs.can_run(4) and not graphs.can_run(5)
    # Three requests replay the size-4 graph (one padding row), then subsets replay smaller
    # ones after it: stale padding from a larger batch must not leak.
    for rows in ([0, 1, 2], [2], [1, 0]):
        # Table rows in another order than the requests: (3 - i) for request i.
        meta = _decode_meta(table, [(3 - i, bases[i], len(PROMPTS[i]) + 2) for i in rows])
        ids = torch.tensor([outputs[i][1] for i in rows])
        positions = torch.tensor([len(PROMPTS[i]) + 1 for i in rows])
        want = model.compute_logits(model.forward(ids, positions, meta))  # [n, vocab]
        got = graphs.replay(ids, positions, meta)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_triton_backend_runs_verify_steps(tiny_llama_dir):
    """A verify step (speculative decoding: the last token and its drafts over the cached
    KV) takes the extend path: through the triton kernels it commits the torch backend's
    tokens, drafts right and wrong."""
    from radixserve.internal.v1 import engine_pb2
    from services.common.transport import pack_i32
    from services.worker import wire

    prompt = PROMPTS[2]
    want = _greedy(tiny_llama_dir, "torch")[2]
    cfg = WorkerConfig(
        model_path=str(tiny_llama_dir), device="cpu", dtype="float32", attention_backend="triton",
        max_total_tokens=256, max_running_requests=4, context_length=64, disable_cuda_graph=True,
    )  # fmt: skip
    runner = ModelRunner(cfg)
    n = len(prompt)
    first = engine_pb2.ForwardRequest(
        req_slot=0, input_ids=pack_i32(prompt), prefix_len=0, out_slots=pack_i32(range(1, n + 1)),
        is_new=True, sample=True, sampling=engine_pb2.SamplingParams(temperature=0),
    )  # fmt: skip
    toks = wire.forward(runner, engine_pb2.ForwardBatch(batch_id=1, reqs=[first])).tokens
    assert toks[0].token_id == want[0]
    drafts = [want[1], want[2], (want[3] + 1) % 300]  # the third is wrong
    verify = engine_pb2.ForwardRequest(
        req_slot=0, input_ids=pack_i32([want[0]]), prefix_len=n,
        out_slots=pack_i32(range(n + 1, n + 5)), sample=True, draft_tokens=pack_i32(drafts),
    )  # fmt: skip
    tok = wire.forward(runner, engine_pb2.ForwardBatch(batch_id=2, reqs=[verify])).tokens[0]
    assert [tok.token_id, *tok.extra_token_ids] == want[1:4]
