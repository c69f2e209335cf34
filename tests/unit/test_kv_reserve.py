"""KV sizing on CUDA budgets what is allocated after the pool (kv_pool.RuntimeReserve):
checked with torch.cuda.mem_get_info faked, so it runs without a GPU."""

import pytest
import torch

from services.worker import kv_pool
from services.worker.kv_pool import KVShape, RuntimeReserve, pool_size_tokens

GiB = 2**30
# Qwen2.5-7B's shapes: 28 layers, 4 KV heads of 128, bf16.
SHAPE = KVShape(28, 4, 128, torch.bfloat16)
RESERVE = RuntimeReserve(
    hidden_size=3584,
    intermediate_size=18944,
    qkv_size=(28 + 8) * 128,
    vocab_size=152064,
    dtype=torch.bfloat16,
    max_running_requests=64,
    graph_batch_rows=295,  # capture_sizes(64)
)
CUDA = torch.device("cuda")


@pytest.fixture
def gpu_with(monkeypatch):
    def set_memory(free: int, total: int) -> None:
        monkeypatch.setattr(kv_pool.torch.cuda, "mem_get_info", lambda device: (free, total))

    return set_memory


def test_reserve_of_a_7b_model_is_counted_in_gigabytes():
    assert 1.5 * GiB < RESERVE.bytes() < 2.5 * GiB


def test_reserve_lowers_the_pool_by_its_size(gpu_with):
    gpu_with(free=120 * GiB, total=140 * GiB)
    plain = pool_size_tokens(SHAPE, CUDA, 0, 0.9, 15 * GiB, cap_tokens=10**9)
    reserved = pool_size_tokens(SHAPE, CUDA, 0, 0.9, 15 * GiB, 10**9, reserve=RESERVE)
    assert plain - reserved == pytest.approx(RESERVE.bytes() / SHAPE.bytes_per_token(), abs=1)


def test_a_share_that_leaves_only_the_reserve_fails_at_start_with_the_numbers(gpu_with):
    # Weights loaded, 3.5 GiB free of 24: a 0.9 share leaves 1.1 GiB, under the ~1.8 reserve.
    gpu_with(free=int(3.5 * GiB), total=24 * GiB)
    with pytest.raises(ValueError, match=r"reserved for activations, CUDA graphs and the sampler"):
        pool_size_tokens(SHAPE, CUDA, 0, 0.9, 15 * GiB, 10**9, reserve=RESERVE)


def test_explicit_pool_size_must_leave_the_reserve_free(gpu_with):
    gpu_with(free=2 * GiB, total=24 * GiB)
    with pytest.raises(ValueError, match="--max-total-tokens needs"):
        pool_size_tokens(SHAPE, CUDA, 10_000, 0.9, 15 * GiB, 10**9, reserve=RESERVE)
    assert pool_size_tokens(SHAPE, CUDA, 100, 0.9, 15 * GiB, 10**9, reserve=None) == 100


def test_cpu_sizing_ignores_the_reserve():
    cpu = torch.device("cpu")
    small = KVShape(2, 2, 16, torch.float32)
    assert pool_size_tokens(small, cpu, 0, 0.1, 0, 5000, reserve=RESERVE) == 5000
