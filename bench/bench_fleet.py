"""The fleet cache side by side (issue 37): three engines behind two frontends, one run per
routing policy, against one engine that serves the whole workload alone.

    multi-turn   64 conversations that share one system prompt, 6 turns each, the sessions
                 split between the two frontends (round robin)
    gsp          generated-shared-prefix: 16 groups of questions behind one system prompt each

For each: cached prompt tokens (and their share of the single engine's), and the most
requests any engine took over the mean (load balance). Engines keep running between
policies; their caches are flushed and the frontends restarted with the next policy.

Then cross-engine reuse through a shared store (a real redis-server): a 4,096-token
document prefilled on engine A, then its prefix asked of engine B, which loads the pages A
wrote instead of computing them; against B computing it (the same document under another
cache salt, which no page has). Time to the first token, median of --reps.

Model: random-weight Llamas over the default tokenizer with a 4k/8k context (built in a
temporary folder): a small one for the routing runs, the ~25M one of bench_hicache for the
reuse timing. Prints markdown tables for docs/benchmarks.md.

    .venv/bin/python bench/bench_fleet.py [--quick] [--skip-routing] [--skip-reuse]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # for tests.* when run as `python bench/...`

import grpc  # noqa: E402

from bench.bench_hicache import MODEL as REUSE_MODEL  # noqa: E402  (the ~25M Llama)
from radixserve.internal.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402
from radixserve.v1 import generation_pb2  # noqa: E402
from services.common.curve import load_keys  # noqa: E402
from services.loadgen import serving  # noqa: E402
from tests.cluster_util import Cluster, until  # noqa: E402
from tests.conftest import make_tiny_zen_model  # noqa: E402
from tests.redis_util import RedisServer  # noqa: E402
from tests.server_util import Server, greedy  # noqa: E402

IPS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
POLICIES = ["prefix_hash", "round_robin", "least_load", "cache_aware"]
ROUTING_MODEL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def workload(name: str, urls: list[str], quick: bool) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serving.add_bench_args(parser)
    common = ["--base-url", ",".join(urls), "--ignore-eos", "--seed", "3", "--disable-tqdm"]
    if name == "multi-turn":
        convs, turns = ("16", "3") if quick else ("64", "6")
        args = ["--workload", "multi-turn", "--num-prompts", convs, "--num-turns", turns,
                "--system-prompt-len", "256", "--input-len", "48", "--output-len", "16",
                "--max-concurrency", "16"]  # fmt: skip
    else:
        per_group = "4" if quick else "8"
        args = ["--workload", "generated-shared-prefix", "--gsp-num-groups", "16",
                "--gsp-prompts-per-group", per_group, "--gsp-system-prompt-len", "512",
                "--gsp-question-len", "48", "--gsp-output-len", "16", "--max-concurrency",
                "16"]  # fmt: skip
    return parser.parse_args(args + common)


def _flush(c: Cluster, ip: str) -> None:
    keys = load_keys(str(c.log_dir / "keys"))
    assert keys is not None
    auth = [("authorization", f"Bearer {keys.control_token()}")]
    with grpc.insecure_channel(f"{ip}:{c.control}") as ch:
        stub = engine_pb2_grpc.SchedulerControlStub(ch)
        until(
            lambda: stub.GetStats(engine_pb2.StatsRequest(), metadata=auth).num_running_reqs == 0,
            30,
            "engine idle",
        )
        reply = stub.FlushCache(engine_pb2.FlushRequest(), metadata=auth, timeout=30)
    assert reply.flushed, reply.message


def run_routing(model: Path, quick: bool, policies: list[str], workloads: list[str]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="radixserve-fleet-") as tmp:
        c = Cluster(Path(tmp))
        try:
            for ip in IPS:
                c.start_engine(ip, ("--max-total-tokens=65536",), model=model)
            c.publish(IPS)
            for ip in IPS:
                c.wait_engine(ip)
            for name in workloads:
                alone = _run_alone(c, model, name, quick)
                rows.append({"workload": name, "policy": "one engine", **alone})
                print(rows[-1], flush=True)
                for policy in policies:
                    rows.append(
                        {"workload": name, "policy": policy, **_run(c, model, name, policy, quick)}
                    )
                    print(rows[-1], flush=True)
        except BaseException:
            print(c.logs())
            raise
        finally:
            c.close()
    return rows


def _requests_done(c: Cluster) -> dict[str, float]:
    return {ip: c.requests_done(ip) for ip in IPS}


def _run(c: Cluster, model: Path, name: str, policy: str, quick: bool) -> dict:
    for ip in IPS:
        _flush(c, ip)
    for proc, _ in c.frontends:
        proc.terminate()
        proc.wait(30)
    c.frontends.clear()
    c.http_ports.clear()
    policy_name, *extra = policy.split(":")  # "cache_aware:--routing-balance-abs-threshold=8"
    for _ in range(2):
        c.start_frontend(f"--routing-policy={policy_name}", *extra, model=model, http=True)
    urls = [f"http://127.0.0.1:{p}" for p in c.http_ports]
    for url in urls:
        until(partial(_ready, url), 60, f"frontend {url} ready")
    time.sleep(2.0)  # every engine probed and subscribed
    before = _requests_done(c)
    start = time.perf_counter()
    rep = serving.benchmark(workload(name, urls, quick))
    wall = time.perf_counter() - start
    taken = {ip: n - before[ip] for ip, n in _requests_done(c).items()}
    mean = sum(taken.values()) / len(taken)
    return {
        "branches": _branches(urls),
        "cached": rep["cached_tokens"],
        "prompt": rep["input_tokens"],
        "errors": rep["errors"],
        "max_over_mean": max(taken.values()) / mean if mean else 0.0,
        "taken": taken,
        "wall_s": wall,
    }


def _branches(urls: list[str]) -> dict[str, int]:
    """Routing decisions of every frontend, by what decided them."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, int] = {}
    for url in urls:
        body = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        for fam in text_string_to_metric_families(body):
            for s in fam.samples:
                if s.name == "radixserve:frontend_routing_decisions_total":
                    out[s.labels["branch"]] = out.get(s.labels["branch"], 0) + int(s.value)
    return out


def _run_alone(c: Cluster, model: Path, name: str, quick: bool) -> dict:
    with Server("--max-total-tokens", "196608", model=model, timeout=600) as s:
        rep = serving.benchmark(workload(name, [f"http://127.0.0.1:{s.http_port}"], quick))
    return {"cached": rep["cached_tokens"], "prompt": rep["input_tokens"], "errors": rep["errors"]}


def _ready(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def run_reuse(model: Path, reps: int) -> dict:
    """TTFT on engine B of a 4,096-token document engine A computed (loaded from the shared
    store) vs the same length that no page has (computed)."""
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as redis:
        flags = (
            "--max-total-tokens", "32768", "--hicache-ratio", "2", "--hicache-write-policy",
            "write_through", "--hicache-storage-url", redis.url, "--hicache-storage-page-tokens",
            "64", "--hicache-storage-timeout-ms", "2000",
        )  # fmt: skip
        loaded, computed = [], []
        with Server(*flags, model=model, timeout=600) as a, Server(*flags, model=model) as b:
            for rep in range(reps):
                doc = [(7 * i + 13 * rep) % 590 + 5 for i in range(4096)]  # the vocabulary: 596
                # B writes what it computes too (write_through): count from a settled store,
                # so that A's pages, not B's last ones, are what is waited for.
                before = _settled_pages(redis)
                _ttft(a, doc, f"warm-{rep}")  # A computes and writes the pages
                until(partial(_enough_pages, redis, before + 4096 // 64), 60, "pages stored")
                loaded.append(_ttft(b, doc + [11], f"warm-{rep}"))
                computed.append(_ttft(b, doc + [11], f"cold-{rep}"))
    lo, co = statistics.median(loaded), statistics.median(computed)
    return {"loaded_s": lo, "computed_s": co, "speedup": co / lo}


def _pages(redis: RedisServer) -> int:
    with redis.client() as c:
        return sum(1 for _ in c.scan_iter(match="radixserve:kv:*", count=1000))


def _enough_pages(redis: RedisServer, want: int) -> bool:
    return _pages(redis) >= want


def _settled_pages(redis: RedisServer) -> int:
    """The page count once no write has landed for half a second."""
    count = _pages(redis)
    while True:
        time.sleep(0.5)
        now = _pages(redis)
        if now == count:
            return count
        count = now


def _ttft(s: Server, ids: list[int], salt: str) -> float:
    start = time.perf_counter()
    req = generation_pb2.GenerateRequest(
        input_ids=generation_pb2.InputIds(ids=ids), sampling=greedy(1), cache_salt=salt
    )
    for _ in s.stub.Generate(req, timeout=600):
        break
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run")
    p.add_argument("--skip-routing", action="store_true")
    p.add_argument("--skip-reuse", action="store_true")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma separated; a policy may carry frontend flags: cache_aware:--flag=v:--flag2=w",
    )
    p.add_argument("--workloads", default="multi-turn,gsp", help="comma separated")
    ns = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not ns.skip_routing:
            model = make_tiny_zen_model(Path(tmp) / "routing", **ROUTING_MODEL)
            rows = run_routing(model, ns.quick, ns.policies.split(","), ns.workloads.split(","))
            print("| workload | policy | cached tokens | of one engine's | max / mean load "
                  "| requests per engine | wall s |")  # fmt: skip
            print("|---|---|---|---|---|---|---|")
            alone = {r["workload"]: r["cached"] for r in rows if r["policy"] == "one engine"}
            for r in rows:
                share = r["cached"] / alone[r["workload"]] if alone[r["workload"]] else 0
                balance = f"{r['max_over_mean']:.2f}" if "taken" in r else "-"
                taken = "/".join(str(int(v)) for v in r["taken"].values()) if "taken" in r else "-"
                wall = f"{r['wall_s']:.1f}" if "wall_s" in r else "-"
                print(f"| {r['workload']} | {r['policy']} | {r['cached']:,} | {share:.1%} | "
                      f"{balance} | {taken} | {wall} |")  # fmt: skip
        if not ns.skip_reuse:
            model = make_tiny_zen_model(Path(tmp) / "reuse", **REUSE_MODEL)
            r = run_reuse(model, ns.reps)
            print(f"\n4,096-token document on engine B: loaded from the shared store "
                  f"{r['loaded_s']:.3f} s, computed {r['computed_s']:.3f} s: "
                  f"{r['speedup']:.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
