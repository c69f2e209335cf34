"""kernels/triton/awq_gemm.py: the Triton dequant-GEMM against its PyTorch reference, and the
reference against the independent packer (tests/awq_packer.py).

Without CUDA the kernel runs in Triton's interpreter (small shapes, a few seconds in all).
On a GPU the same tests run compiled, plus float16/bfloat16 at serving sizes, a CUDA-graph
replay, and a tiny AWQ model served through the kernel.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402
from awq_packer import Quantized, pack, write_awq_model  # noqa: E402

from kernels.triton.awq_gemm import GemmConfig, awq_gemm, awq_gemm_ref  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# The reference rounds W to x's dtype as the kernel does and sums in float32 too: only the
# summation order differs.
TOL = {
    torch.float32: dict(atol=1e-4, rtol=1e-5),
    torch.float16: dict(atol=2e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=5e-2, rtol=2e-2),
}


def random_awq(k: int, n: int, group: int, seed: int = 0) -> tuple[Quantized, tuple]:
    """Random 4-bit values, zeros and float16 scales; (the packer's view, packed tensors)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(0, 16, (k // group, n), generator=g)
    s = (0.002 + 0.02 * torch.rand(k // group, n, generator=g)).half()
    quant = Quantized(q, z, s)
    return quant, tuple(t.to(DEVICE) for t in (pack(q), pack(z), s))


def x_of(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(DEVICE, dtype)


CASES = [  # M, K, N, group
    (1, 128, 96, 32),
    (7, 128, 40, 64),  # N not a multiple of the tile: masked columns
    (33, 64, 64, 64),  # several M tiles
    (3, 96, 32, 96),  # group_size -1 stored as one group over K (K = 96: K tile 32)
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # bf16 on CPU: kernels/triton/_triton.py


@pytest.mark.parametrize("m, k, n, group", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_reference(m, k, n, group, dtype):
    _, (qw, qz, s) = random_awq(k, n, group)
    x = x_of(m, k, dtype)
    bias = torch.randn(n).to(DEVICE, dtype)
    for b in (None, bias):
        got = awq_gemm(x, qw, qz, s, b)
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got, awq_gemm_ref(x, qw, qz, s, b), **TOL[dtype])


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_matches_reference(split_k):
    """Decode's K split (partials summed afterwards), the bias added once."""
    _, (qw, qz, s) = random_awq(192, 64, 32, seed=2)
    x = x_of(5, 192, torch.float32)
    bias = torch.randn(64).to(DEVICE)
    cfg = GemmConfig(16, 32, 32, split_k, 4, 1)
    got = awq_gemm(x, qw, qz, s, bias, config=cfg)
    torch.testing.assert_close(got, awq_gemm_ref(x, qw, qz, s, bias), **TOL[torch.float32])


def test_reference_matches_the_packer():
    """The reference dequantizes the packed words exactly as the packer's integers say."""
    quant, (qw, qz, s) = random_awq(128, 48, 32, seed=3)
    x = x_of(4, 128, torch.float64)  # float64: the only rounding is the sums'
    want = x.cpu() @ quant.dequantized().t().double()
    torch.testing.assert_close(awq_gemm_ref(x, qw, qz, s).cpu(), want)


def test_empty_batch():
    _, (qw, qz, s) = random_awq(64, 32, 32)
    assert awq_gemm(x_of(0, 64, torch.float32), qw, qz, s).shape == (0, 32)


def test_bad_shapes_are_refused():
    _, (qw, qz, s) = random_awq(128, 32, 32)
    x = x_of(2, 128, torch.float32)
    with pytest.raises(ValueError, match=r"x must be \[M, 128\]"):
        awq_gemm(x_of(2, 96, torch.float32), qw, qz, s)
    with pytest.raises(ValueError, match="qzeros must be"):
        awq_gemm(x, qw, qz[:, :2], s)
    with pytest.raises(ValueError, match="disagree"):  # 128 rows in 3 groups
        awq_gemm(x, qw, qz[:3], s[:3])
    with pytest.raises(ValueError, match="int32"):
        awq_gemm(x, qw.long(), qz, s)
    with pytest.raises(ValueError, match="does not divide the group size"):
        awq_gemm(x, qw, qz, s, config=GemmConfig(16, 32, 64, 1, 4, 1))
    _, (qw72, qz72, s72) = random_awq(72, 32, 72)  # one group of 72: no K tile >= 16 fits
    with pytest.raises(ValueError, match="group size 72"):
        awq_gemm(x_of(1, 72, torch.float32), qw72, qz72, s72)


# ---- GPU only: serving sizes, CUDA graphs, a model through the kernel --------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


@gpu
@pytest.mark.parametrize("m", [1, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_at_serving_sizes(m, dtype):
    _, (qw, qz, s) = random_awq(4096, 1024, 128, seed=4)
    x = x_of(m, 4096, dtype)
    got, want = awq_gemm(x, qw, qz, s), awq_gemm_ref(x, qw, qz, s)
    torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)


@gpu
def test_kernel_replays_in_a_cuda_graph():
    _, (qw, qz, s) = random_awq(1024, 512, 128, seed=5)
    x = x_of(4, 1024, torch.float16)
    awq_gemm(x, qw, qz, s)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = awq_gemm(x, qw, qz, s)
    x.copy_(x_of(4, 1024, torch.float16, seed=9))
    graph.replay()
    torch.testing.assert_close(y, awq_gemm(x, qw, qz, s), atol=0, rtol=0)


@gpu
def test_awq_model_through_the_kernel(tiny_llama_dir, tmp_path):
    """The worker on CUDA keeps AWQ packed and runs the kernel: logits near the same model
    dequantized (float16 both), and greedy decode with CUDA graphs equals eager."""
    from bench.gpu_model_check import generate  # protobuf-free, as the GPU image needs
    from services.common.config import WorkerConfig
    from services.worker.layers import AwqLinear
    from services.worker.model_loader import load_model
    from services.worker.model_runner import ModelRunner

    folder = write_awq_model(tiny_llama_dir, tmp_path / "awq", 32)[0]
    dev = torch.device("cuda")
    packed, _ = load_model(str(folder), torch.float16, dev, progress=False)
    dense, _ = load_model(str(folder), torch.float16, dev, progress=False, dequantize=True)
    assert any(isinstance(mod, AwqLinear) for mod in packed.modules())
    x = torch.randn(9, 64, device=dev, dtype=torch.float16)
    for a, b in zip(packed.model.layers, dense.model.layers, strict=True):
        torch.testing.assert_close(a.mlp(x), b.mlp(x), atol=2e-2, rtol=2e-2)
    cfg = dict(model_path=str(folder), device="cuda", max_total_tokens=4096)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    eager = generate(ModelRunner(WorkerConfig(**cfg, disable_cuda_graph=True)), prompts, 16)
    graphed = generate(ModelRunner(WorkerConfig(**cfg)), prompts, 16)
    assert graphed == eager


# ---- CPU only: the kernel compiles for real GPUs (Triton's bundled ptxas, no device) -------

_COMPILE = r"""
import os
os.environ["TRITON_INTERPRET"] = "0"  # decorate the kernel for compilation, not the interpreter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.triton.awq_gemm import _awq_gemm_kernel

INTS = "M N K k_per_split stride_xm stride_xk stride_qk stride_zg stride_sg stride_os stride_om"
CONFIGS = [  # dtype, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: choose_config's decode / prefill
    ("fp16", 16, 128, 128, 4, 4),
    ("bf16", 64, 128, 64, 8, 4),
    ("fp16", 128, 128, 64, 8, 3),
]
for arch, (dt, bm, bn, bk, warps, stages) in [(90, c) for c in CONFIGS] + [(80, CONFIGS[0])]:
    sig = dict(X="*" + dt, QW="*i32", QZ="*i32", S="*fp16", Bias="*" + dt, Out="*" + dt)
    sig.update({k: "i32" for k in INTS.split()})
    consts = dict(GROUP=128, HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    consts["DOT_PRECISION"] = "tf32"
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn=_awq_gemm_kernel, signature=sig, constexprs=consts)
    options = dict(num_warps=warps, num_stages=stages)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    assert kernel.asm["cubin"], (arch, dt)
print("compiled")
"""


@pytest.mark.skipif(ON_GPU, reason="on a GPU the tests above compile it for real")
def test_kernel_compiles_for_sm90_and_sm80():
    """Catches what the interpreter cannot (layouts, types, shared memory) without a GPU."""
    import subprocess
    import sys
    from pathlib import Path

    nvidia = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not nvidia.exists():
        pytest.skip("this triton has no bundled ptxas")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1", "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", _COMPILE], cwd=root, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
