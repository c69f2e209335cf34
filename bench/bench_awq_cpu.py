"""CPU: load time and resident memory of an AWQ int4 model against its float twin.

Builds a random-weight Llama (~134 M parameters: hidden 768, 12 layers, intermediate 2048,
vocabulary 32,000, untied head), saves it as float32 safetensors, quantizes its decoder
linears with the test packer (tests/awq_packer.py, group 128) into an AWQ folder, then
loads each folder in a fresh process through radixserve's loader:

  float32            the float folder (what a float checkpoint costs)
  awq -> float32     the AWQ folder, dequantized once at load (the CPU serving path)
  awq packed         the AWQ folder kept packed (dequantize=False: what the GPU holds)

and reports the load time (median of --repeats processes), the resident memory the load
added (VmRSS after minus before) and its peak (VmHWM minus the same start; the peak also
counts the memory-mapped safetensors pages while they are being copied), the weight bytes
the worker counts for its KV sizing, and the size on disk.

    .venv/bin/python bench/bench_awq_cpu.py [--repeats 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MODEL = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
GROUP = 128

# Runs in a fresh interpreter: imports first, then RSS before / load / RSS after.
_CHILD = r"""
import json, sys, time
import torch
from services.worker.model_loader import load_model, weight_nbytes
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
torch.set_num_threads(1)
before = status("VmRSS:")
start = time.perf_counter()
model, _ = load_model(sys.argv[1], torch.float32, torch.device("cpu"), progress=False,
                      dequantize=None if sys.argv[2] == "auto" else False)
seconds = time.perf_counter() - start
rss, peak = status("VmRSS:") - before, status("VmHWM:") - before
print(json.dumps(dict(seconds=seconds, rss=rss, peak=peak, weights=weight_nbytes(model))))
"""


def build(workdir: Path) -> tuple[Path, Path]:
    import torch
    import transformers
    from awq_packer import write_awq_model

    float_dir, awq_dir = workdir / "float", workdir / "awq"
    if not float_dir.exists():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
        model.save_pretrained(float_dir, safe_serialization=True)
    if not awq_dir.exists():
        write_awq_model(float_dir, awq_dir, GROUP)
    return float_dir, awq_dir


def measure(folder: Path, mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-awq-"))
    float_dir, awq_dir = build(workdir)
    cases = [
        ("float32", float_dir, "auto"),
        ("awq -> float32 (CPU path)", awq_dir, "auto"),
        ("awq packed (GPU layout)", awq_dir, "packed"),
    ]
    mib = 2**20
    print("| model | load s (median) | +RSS MiB | +peak RSS MiB | weights MiB | disk MiB |")
    print("|---|---|---|---|---|---|")
    for label, folder, mode in cases:
        runs = [measure(folder, mode) for _ in range(args.repeats)]
        last = runs[-1]
        print(
            f"| {label} | {statistics.median(r['seconds'] for r in runs):.2f} "
            f"| {last['rss'] / mib:.0f} | {last['peak'] / mib:.0f} "
            f"| {last['weights'] / mib:.0f} | {disk_bytes(folder) / mib:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
