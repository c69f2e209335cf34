"""The whole server on the GPU: `radixserve serve` (frontend, scheduler and worker as three
processes, ZeroMQ and gRPC between them) on the embedded default model, greedy requests
compared token for token with transformers on the same model, then one `radixserve bench`
shared-prefix burst. One gpu_check row per check, printed as measured (bench/gpu_rows.py).

    python3 bench/gpu_server.py [--site DIR]      # on a CUDA machine
    python3 bench/gpu_server.py --smoke           # the same on CPU (make test)

The server processes need pyzmq, protobuf, grpcio, xgrammar, pydantic, fastapi...: on the GPU
image they come from the carried wheels, installed by gpu_check.sh into ``--site``, which goes
on the children's PYTHONPATH only; this process itself needs just torch, transformers, httpx.
Rows: cache miss, cache hit (cached tokens = prompt - 1), a chunked prefill (prompt longer
than --chunked-prefill-size), a JSON-schema constraint, the bench burst (cached tokens, tok/s).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_rows import emit, verdict  # noqa: E402

MODEL = ROOT / "services" / "common" / "default_model" / "radixserve-zen"
CHUNK = 64  # --chunked-prefill-size: the long prompt below takes several chunks
NEW_TOKENS = 12
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],  # bounded: a tiny model's integers can run to max_tokens
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`radixserve serve` in its own process group, its log in a temp file."""

    def __init__(self, device: str, site: str | None, timeout_s: float):
        self.http_port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="gpu-server-", suffix=".log")
        cmd = [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "--model-path",
            str(MODEL),
            "--device",
            device,
            "--dtype",
            "float32",  # greedy ties: compared with transformers in float32 too
            "--port",
            str(free_port()),
            "--http-port",
            str(self.http_port),
            "--chunked-prefill-size",
            str(CHUNK),
            "--max-total-tokens",
            "16384",
        ]
        self.env = child_env(site)
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.http_port}"
        try:
            self._wait(timeout_s)
        except BaseException:  # a failed or interrupted start leaves no server behind
            self.close()
            raise

    def _wait(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"radixserve serve exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:  # engines up
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"not serving after {timeout_s:.0f} s: {self.tail()}")

    def tail(self, lines: int = 15) -> str:
        self.log.flush()
        return " / ".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def generate(self, ids: list[int], **sampling: Any) -> dict[str, Any]:
        import httpx

        params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, **sampling}
        body = {"input_ids": ids, "sampling_params": params}
        r = httpx.post(self.url + "/generate", json=body, timeout=300)
        if r.status_code != 200:
            raise RuntimeError(f"/generate answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def child_env(site: str | None) -> dict[str, str]:
    paths = [p for p in (site, str(ROOT), os.environ.get("PYTHONPATH")) if p]
    return {**os.environ, "PYTHONPATH": ":".join(paths), "TOKENIZERS_PARALLELISM": "false"}


class Reference:
    """transformers' own model of the folder, float32, greedy without EOS (as ignore_eos)."""

    def __init__(self, device: str):
        import torch
        import transformers

        self.torch, self.device = torch, device
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL)
        model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
        self.model = model.to(device).eval()

    def greedy(self, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
        torch = self.torch
        out = list(ids)
        with torch.no_grad():
            for _ in range(n):
                logits = self.model(torch.tensor([out], device=self.device)).logits[0, -1]
                out.append(int(logits.argmax()))
        return out[len(ids) :]


def greedy_rows(server: Served, ref: Reference) -> None:
    """Miss, hit and chunked prefill: the same tokens as transformers each time."""
    tok = ref.tokenizer
    short = tok.encode("The radix tree keeps every prefix it has seen, so a second request")
    long = tok.encode(
        " ".join(f"item {i} of a list that is long enough to chunk" for i in range(12))
    )
    want_short, want_long = ref.greedy(short), ref.greedy(long)
    cases = [
        ("cache miss", short, want_short, lambda c: c == 0, "cached 0"),
        ("cache hit (same prompt again)", short, want_short, lambda c: c == len(short) - 1,
         f"cached {len(short) - 1}"),
        (f"chunked prefill ({len(long)} tokens, chunks of {CHUNK})", long, want_long,
         lambda c: True, "same tokens"),
    ]  # fmt: skip
    for name, ids, want, cached_ok, target in cases:
        got = server.generate(ids, ignore_eos=True)
        cached = int(got["meta_info"].get("cached_tokens", -1))
        same = got["output_ids"] == want
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(got["output_ids"], want, strict=False)) if a != b),
            None,
        )
        emit(
            f"server greedy vs transformers, {name}",
            f"{'same' if same else f'DIFFERENT from token {first_diff}'} "
            f"({len(want)} tokens); cached_tokens {cached}",
            f"same tokens, {target}",
            verdict(same and cached_ok(cached)),
        )


def schema_row(server: Served, ref: Reference) -> None:
    prompt = ref.tokenizer.encode("A person as JSON:")
    got = server.generate(prompt, max_new_tokens=64, json_schema=json.dumps(SCHEMA))
    text, finish = got["text"], got["meta_info"].get("finish_reason")
    try:
        value = json.loads(text)
        ok = (
            isinstance(value, dict)
            and isinstance(value.get("name"), str)
            and len(value["name"]) <= 10
            and isinstance(value.get("ok"), bool)
        )
    except ValueError:
        ok = False
    emit(
        "server JSON-schema constraint (xgrammar in the worker)",
        f"{text[:80]!r}, finish {finish.get('type') if isinstance(finish, dict) else finish}",
        "valid JSON of the schema",
        verdict(ok),
    )


def bench_row(server: Served, smoke: bool) -> None:
    """One shared-prefix burst through `radixserve bench`: cached tokens and tok/s."""
    groups, per_group, system, output = (2, 4, 64, 8) if smoke else (8, 16, 512, 64)
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "services.cli", "bench", "--base-url", server.url]
        cmd += ["--workload", "generated-shared-prefix", "--gsp-num-groups", str(groups)]
        cmd += ["--gsp-prompts-per-group", str(per_group), "--gsp-system-prompt-len", str(system)]
        cmd += ["--gsp-question-len", "32", "--gsp-output-len", str(output), "--ignore-eos"]
        cmd += ["--disable-tqdm", "--output-json", str(report)]
        run = subprocess.run(
            cmd, cwd=ROOT, env=server.env, capture_output=True, text=True, timeout=240
        )
        if run.returncode != 0 or not report.exists():
            raise RuntimeError(f"radixserve bench exited {run.returncode}: {run.stdout[-400:]}")
        rep = json.loads(report.read_text())
    n = groups * per_group
    cached = rep.get("cached_tokens") or 0
    ok = rep["completed"] == n and rep["errors"] == 0 and cached > 0
    emit(
        f"radixserve bench, generated-shared-prefix burst ({groups} x {per_group} prompts, "
        f"{system}-token system prompts, {output} new tokens)",
        f"{rep['completed']}/{n} done, {rep['errors']} errors; cached {cached:,} tokens "
        f"(hit rate {rep.get('cache_hit_rate') or 0:.2f}); {rep['output_throughput']:,.0f} "
        f"output tok/s, {rep['input_throughput']:,.0f} input tok/s",
        "all done, cached > 0",
        verdict(ok),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="on CPU, a smaller burst")
    parser.add_argument("--site", default=None, help="folder of the installed carried wheels")
    parser.add_argument("--startup-timeout", type=float, default=150.0)
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    server = None
    # gpu_check.sh's deadline or signal (through timeout): close the server on the way out,
    # else its three processes outlive the check.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        ref = Reference(device)
        server = Served(device, args.site, args.startup_timeout)
        for part in (greedy_rows, schema_row):
            part(server, ref)
        bench_row(server, args.smoke)
    except Exception as e:  # one FAIL row naming the cause; the verdict stays last
        where = f"; server log: {server.tail(6)}" if server else ""
        emit("whole server on " + device, f"ERROR {type(e).__name__}: {e}{where}"[:600], "", "FAIL")
        return 1
    finally:
        if server is not None:
            server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
