"""A whole model through the ``triton`` attention backend gives the ``torch`` backend's tokens.

Without CUDA the Triton kernels run in the interpreter, so the model is tiny and the runs short.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402

from services.common.config import WorkerConfig  # noqa: E402
from services.worker.model_runner import ModelRunner  # noqa: E402
from services.worker.offline import generate  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11], [8, 8, 8, 8, 8, 8, 8, 60, 61]]


def _greedy(model_dir, backend: str) -> list[list[int]]:
    cfg = WorkerConfig(model_path=str(model_dir), device="cpu", dtype="float32", attention_backend=backend,
                       max_total_tokens=256, max_running_requests=4, context_length=64, disable_cuda_graph=True)
    runner = ModelRunner(cfg)
    assert runner.backend_name == backend
    return generate(runner, PROMPTS, max_new_tokens=6, stop_at_eos=False)


@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen3_dir"])  # head dims 16 and 32
def test_triton_backend_greedy_tokens_equal_torch_backend(arch_dir, request):
    model_dir = request.getfixturevalue(arch_dir)
    want = _greedy(model_dir, "torch")
    assert [len(t) for t in want] == [6, 6, 6]
    assert _greedy(model_dir, "triton") == want
