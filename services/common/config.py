"""Configuration of the three services: frozen dataclasses whose defaults feed the CLI.

A field becomes the flag ``--field-name`` (SGLang's names where the concept matches) and can
come from the environment as ``RADIXSERVE_FIELD_NAME`` (how containers and the Helm chart set
it). ``radixserve serve`` takes the union of the three: a shared field is one flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import os
import ssl
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

# The project's own small Llama, shipped as package data so the default works from a
# checkout and an installed wheel alike.
DEFAULT_MODEL_PATH = str(Path(__file__).resolve().parent / "default_model" / "radixserve-zen")
ENV_PREFIX = "RADIXSERVE_"


def _opt(
    default,
    help: str,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    **kw,
):
    """A config field with its --help text and, for a number, bounds ``ge``/``gt``/``le``,
    held by the flag, RADIXSERVE_<NAME> and the constructor alike (``field_error``)."""
    kw |= {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le)) if v is not None}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def _secret(help: str):
    """A secret field (an API key): never in repr (log lines), --help or a child's argv
    (``ps`` shows argv to every local user); the flag wins over RADIXSERVE_<NAME>."""
    return field(default="", repr=False, metadata={"help": help, "secret": True})


# Internal-link authentication: the same two flags in every service (services/common/curve.py).
_KEYS_DIR_HELP = (
    "folder of CURVE keys and the control token of the internal links (`radixserve keys "
    "generate DIR`); empty: ipc links only, unauthenticated inside the private 0700 folder"
)
_INSECURE_HELP = (
    "allow tcp:// internal links without --internal-keys-dir (anyone who reaches the port "
    "can send frames: for tests and trusted networks only)"
)
_TLS_FILES = ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs")
# Control gRPC TLS: servers take certificate and key, clients the CA; empty: plaintext.
_CONTROL_CERT_HELP = (
    "PEM certificate (chain) of the control gRPC server (TLS; its clients need "
    "--control-ssl-ca-certs); empty: plaintext"
)
_CONTROL_KEY_HELP = "PEM private key of --control-ssl-certfile"


def check_tls_files(cfg, prefix: str = "") -> None:
    """ValueError naming the flag unless ``cfg``'s TLS files (``prefix`` "control_": the
    control link's) come in pairs and are readable PEM, so a bad path stops before any bind."""

    def flag(name: str) -> str:
        return "--" + (prefix + name).replace("_", "-")

    cert, key, ca = (getattr(cfg, prefix + n, "") for n in _TLS_FILES)
    if bool(cert) != bool(key):
        raise ValueError(f"{flag('ssl_certfile')} and {flag('ssl_keyfile')} go together")
    for name, path in zip(_TLS_FILES, (cert, key, ca), strict=True):
        if path and not os.access(path, os.R_OK):
            raise ValueError(f"{flag(name)}: cannot read {path}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        if cert:
            ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(
            f"{flag('ssl_certfile')}: not a PEM certificate of the key ({e})"
        ) from None
    try:
        if ca:
            ctx.load_verify_locations(ca)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"{flag('ssl_ca_certs')}: not a PEM CA bundle ({e})") from None


@dataclass(frozen=True)
class WorkerConfig:
    model_path: str = _opt(
        DEFAULT_MODEL_PATH, "HF-format model folder (config.json, *.safetensors, tokenizer)"
    )
    served_model_name: str = _opt("", "model id reported to clients (default: the folder's name)")
    dtype: str = _opt(
        "auto", "weights and KV dtype", choices=["auto", "float32", "bfloat16", "float16"]
    )
    device: str = _opt(
        "auto", "cuda or cpu (auto: cuda when available)", choices=["auto", "cuda", "cpu"]
    )
    attention_backend: str = _opt("auto", "attention backend (auto: triton on cuda, torch on cpu)")
    mem_fraction_static: float = _opt(
        0.0, "share of device memory for weights + KV pool (0: 0.85 on cuda, 0.3 of RAM on cpu)"
    )
    max_total_tokens: int = _opt(0, "KV pool size in tokens (0: derive from --mem-fraction-static)")
    hicache_ratio: float = _opt(
        0.0,
        "hierarchical cache: a host-memory tier of this many times the device pool's tokens, "
        "where evicted prefixes wait to be loaded back instead of recomputed (0: off)",
    )
    hicache_size: float = _opt(
        0.0, "hierarchical cache: the host tier's size in GiB (overrides --hicache-ratio; 0: off)"
    )
    hicache_storage_dir: str = _opt(
        "",
        "hierarchical cache: a directory (local disk or a shared volume) where KV pages "
        "outlive the host tier and a restart, shared by every engine of one model on it "
        "(needs the host tier; empty: no storage tier)",
    )
    hicache_storage_url: str = _opt(
        "",
        "hierarchical cache: a Redis-protocol server (Redis, Valkey) keeping the storage "
        "tier's KV pages for every engine of one model given it, redis://[:password@]host:"
        "port/db or rediss:// (TLS) (needs the host tier; exclusive with "
        "--hicache-storage-dir; empty: no such server)",
    )
    hicache_storage_password: str = _secret(
        "password of --hicache-storage-url's server when the URL has none (keeps it out of "
        "argv). Env: RADIXSERVE_HICACHE_STORAGE_PASSWORD"
    )
    hicache_storage_tls_ca: str = _opt(
        "", "CA certificate file that --hicache-storage-url's server (rediss://) is checked by"
    )
    hicache_storage_ttl: int = _opt(
        86400,
        "seconds a page stays in --hicache-storage-url's server after it is written (0: no expiry)",
        ge=0,
    )
    hicache_storage_timeout_ms: int = _opt(
        50,
        "connect and read timeout of --hicache-storage-url's server: a server down or slow "
        "costs a batch at most about this long, and its pages are misses",
        ge=1,
    )
    hicache_storage_page_tokens: int = _opt(
        64, "tokens per page of the storage tier (a multiple of --page-size)"
    )
    max_running_requests: int = _opt(
        64, "requests decoded at once (rows of the request-slot table)"
    )
    context_length: int = _opt(
        0, "max prompt + output tokens (0: the model's max_position_embeddings)"
    )
    disable_cuda_graph: bool = _opt(False, "do not capture decode in CUDA graphs")
    cuda_graph_max_bs: int = _opt(64, "largest decode batch captured in a CUDA graph")
    random_seed: int = _opt(0, "seed for requests that give none")
    tp_size: int = _opt(
        1,
        "tensor parallelism: the worker runs as this many ranks (processes on one node, one "
        "GPU each on cuda), each holding 1/N of the weights and of the KV heads",
        ge=1,
        le=64,
    )
    tp_timeout: float = _opt(
        600.0,
        "tensor parallelism: seconds a collective waits for the other ranks before the engine "
        "goes down (a hung rank never hangs it forever)",
        gt=0,
    )
    tp_rank: int = _opt(
        0, "tensor parallelism, set by rank 0 for the ranks it starts: this process's rank", ge=0
    )
    tp_store: str = _opt("", "tensor parallelism, set by rank 0: the ranks' rendezvous file")
    cpu_threads: int = _opt(
        0, "torch threads on CPU (0: one per core this process may use, split between TP ranks)"
    )
    cpu_wait: str = _opt(
        "adaptive",
        "how CPU worker threads wait between parallel ops: spin ~0.5 ms then sleep (spin), "
        "sleep at once (passive), or spin and run each batch size with every thread or one "
        "fewer, whichever measured faster (adaptive); OMP_WAIT_POLICY / GOMP_SPINCOUNT win",
        choices=["adaptive", "spin", "passive"],
    )
    cpu_bind: str = _opt(
        "auto",
        "CPU worker: pin its OpenMP threads one per core, so a step's threads keep their "
        "cores and caches (auto: where the ranks' threads take every core the process may "
        "use, one each, and no GPU is present, rank r of --tp-size takes the r-th run of "
        "--cpu-threads of them; none; or a core list such as 0-3 or 0,2,4,6); "
        "OMP_PROC_BIND / OMP_PLACES / GOMP_CPU_AFFINITY / KMP_AFFINITY win",
    )
    cpu_linear: str = _opt(
        "auto",
        "float32 linears on CPU: packed (oneDNN, weights prepacked once at load), hybrid "
        "(packed, plus the dense weights for batches of few rows, which a C kernel runs "
        "faster: 2x the linears' memory), plain (F.linear, MKL) or auto (hybrid while the "
        "linears' float32 weights take at most 2 GiB, else packed)",
        choices=["auto", "packed", "hybrid", "plain"],
    )
    grammar_compile_timeout: float = _opt(
        10.0,
        "seconds a constrained request waits for its grammar to compile before it fails "
        "(the compile goes on, and its result is cached for the next request)",
    )
    grammar_cache_size: int = _opt(
        128, "compiled grammars kept (LRU, keyed by constraint kind + text)"
    )
    grammar_compile_threads: int = _opt(2, "threads compiling grammars beside the forward steps")
    worker_addr: str = _opt(
        "", "ZeroMQ address the worker binds for its scheduler (default: a per-instance ipc path)"
    )
    worker_grpc_port: int = _opt(0, "gRPC info/health port of the worker (0: a free port)")
    shutdown_grace_period: float = _opt(
        30.0,
        "on SIGTERM the worker keeps running its scheduler's batches (the scheduler drains) "
        "and exits once none came for a second, or after this many seconds",
    )
    internal_keys_dir: str = _opt("", _KEYS_DIR_HELP)
    insecure_internal: bool = _opt(False, _INSECURE_HELP)
    control_ssl_certfile: str = _opt("", _CONTROL_CERT_HELP)
    control_ssl_keyfile: str = _opt("", _CONTROL_KEY_HELP)
    host: str = _opt("127.0.0.1", "interface the gRPC servers bind")
    enable_metrics: bool = _opt(False, "serve Prometheus /metrics")
    metrics_port: int = _opt(0, "port of this process's /metrics (0: a free port)")
    otlp_traces_endpoint: str = _opt(
        "", "OTLP/gRPC endpoint for traces, e.g. localhost:4317 (off when empty)"
    )
    log_level: str = _opt("info", "logging level", choices=["debug", "info", "warning", "error"])

    def __post_init__(self) -> None:
        url = self.hicache_storage_url
        if url and self.hicache_storage_dir:
            raise ValueError(
                "--hicache-storage-dir and --hicache-storage-url are exclusive: give one "
                "storage tier"
            )
        scheme = url.partition("://")[0] if "://" in url else ""
        if url and scheme not in ("redis", "rediss"):
            got = f"{scheme}://" if scheme else "no scheme"  # not the URL: it may hold a password
            raise ValueError(f"--hicache-storage-url must start redis:// or rediss://, got {got}")
        if self.hicache_storage_tls_ca and scheme != "rediss":
            raise ValueError("--hicache-storage-tls-ca needs a rediss:// --hicache-storage-url")
        check_tls_files(self, "control_")
        check_bounds(self)
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"--tp-rank {self.tp_rank} must be below --tp-size {self.tp_size}")
        if self.tp_rank and not self.tp_store:
            raise ValueError("--tp-rank needs --tp-store (rank 0 sets both)")


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = _opt(1, "tokens per KV page; the radix tree caches whole pages only")
    radix_eviction_policy: str = _opt(
        "lru", "which cached leaves go first", choices="services.scheduler.eviction:policy_names"
    )
    slru_protected_hits: int = _opt(
        2, "slru: hits after which a node moves to the protected segment"
    )
    disable_radix_cache: bool = _opt(False, "compute every prompt from scratch (nothing cached)")
    schedule_policy: str = _opt(
        "lpm", "waiting-queue order", choices="services.scheduler.schedule_policy:policy_names"
    )
    chunked_prefill_size: int = _opt(
        2048, "prefill at most this many new tokens of one request per batch (-1: no chunking)"
    )
    max_prefill_tokens: int = _opt(
        0,
        "new tokens in one prefill batch at most (0: 8192 on a GPU worker, 2048 on a CPU one, "
        "where a batch's first tokens leave only when all of it is computed, seconds later)",
        ge=0,  # 0 already means "the default": a negative is a typo
    )
    mixed_prefill_tokens: int = _opt(
        128,
        "while requests decode, each batch carries every decoding request's next token plus "
        "at most this many prefill tokens (mixed batches), so prefill never stalls decoding "
        "(0, or --chunked-prefill-size -1: a prefill batch runs alone, before any decode step)",
        ge=0,
    )
    mixed_burst_tokens: int = _opt(
        2048,
        "while at least as many requests wait for their first token as decode (a burst of "
        "arrivals), mixed batches carry up to this many prefill tokens instead of "
        "--mixed-prefill-tokens: the burst is admitted in a few longer steps instead of a "
        "trickle of short ones (0: always --mixed-prefill-tokens)",
    )
    mixed_step_slowdown: float = _opt(
        3.0,
        "outside bursts, a mixed batch also carries no more prefill tokens than keep it within "
        "about this many decode steps' time, by the worker's measured forward times (a large "
        "model on a CPU gets fewer than --mixed-prefill-tokens a step; 0: that fixed budget)",
        ge=0,
    )
    max_running_requests: int = _opt(
        64, "requests decoded at once (rows of the request-slot table)"
    )
    disable_overlap_schedule: bool = _opt(
        False, "wait for each decode step's tokens before sending the next step"
    )
    speculative_algorithm: str = _opt(
        "none",
        "speculative decoding without a draft model (docs/speculative.md): each decode step "
        "verifies tokens drafted from the request's own prompt and output (ngram: prompt "
        "lookup) or also from every sequence the engine saw in its namespace (suffix: "
        "SuffixDecoding's suffix index), so repetitive text takes several tokens a step; "
        "the outputs are those of speculation off (none)",
        choices="services.scheduler.speculative:algorithm_names",
    )
    speculative_num_draft_tokens: int = _opt(
        8,
        "speculation: tokens drafted per request and step at most (each request's length "
        "adapts to its acceptance, down to 0)",
        ge=1,
        le=16,
    )
    speculative_gate: str = _opt(
        "goodput",
        "speculation: goodput runs a step's drafts only while verify steps have been bringing "
        "more tokens per second than plain ones, by the step times the scheduler measures (a "
        "verify step costs more, and pauses the overlap schedule); always verifies whatever "
        "was drafted",
        choices="services.scheduler.spec_gate:gate_names",
    )
    speculative_index_tokens: int = _opt(
        1 << 18,
        "speculation (suffix): tokens the draft index holds at most, least recently used "
        "sequences evicted first (each costs the scheduler a few hundred bytes)",
        ge=1,
    )
    hicache_write_policy: str = _opt(
        "write_back",
        "when KV reaches the host tier: on eviction from the device (write_back), as soon as "
        "it is cached (write_through), or at its second hit (write_through_selective)",
        choices=["write_back", "write_through", "write_through_selective"],
    )
    max_queued_requests: int = _opt(
        0,
        "requests waiting for admission beyond which a new one is refused at once (HTTP 429 "
        "with Retry-After / gRPC RESOURCE_EXHAUSTED) (0: 8 x --max-running-requests; -1: no "
        "limit)",
        ge=-1,
    )
    max_total_queued_tokens: int = _opt(
        0,
        "prompt tokens waiting for admission beyond which a new request is refused as "
        "overloaded (0: 4 x the KV pool; -1: no limit)",
        ge=-1,
    )
    max_queue_time: float = _opt(
        0.0,
        "seconds a request may wait for admission before it fails DEADLINE_EXCEEDED (HTTP "
        "504) (0: no limit)",
        ge=0,
    )
    scheduler_addr: str = _opt(
        "", "ZeroMQ address the scheduler binds for frontends (default: a per-instance ipc path)"
    )
    worker_addr: str = _opt("", "ZeroMQ address of the worker to drive")
    control_port: int = _opt(0, "gRPC control port (flush, stats, health) (0: a free port)")
    cache_events_port: int = _opt(
        0,
        "ZeroMQ PUB port (on --host) where the radix tree's blocks stored and removed are "
        "published for the frontends' cache-aware routing (0: a free port, reported in "
        "GetStats; -1: off)",
    )
    cache_event_block_tokens: int = _opt(
        16, "tokens per block in the cache events (the routers' match granularity)"
    )
    worker_result_timeout: float = _opt(
        120.0,
        "seconds a connected worker may take to answer one batch before its requests fail "
        "UNAVAILABLE and the scheduler reconnects (a dead worker is noticed at once: socket "
        "monitor and ZeroMQ heartbeats)",
    )
    shutdown_grace_period: float = _opt(
        30.0,
        "on SIGTERM: NOT_SERVING and new requests refused (UNAVAILABLE) at once; running "
        "requests get this many seconds to finish, then fail UNAVAILABLE",
    )
    internal_keys_dir: str = _opt("", _KEYS_DIR_HELP)
    insecure_internal: bool = _opt(False, _INSECURE_HELP)
    control_ssl_certfile: str = _opt("", _CONTROL_CERT_HELP)
    control_ssl_keyfile: str = _opt("", _CONTROL_KEY_HELP)
    host: str = _opt("127.0.0.1", "interface the gRPC servers bind")
    decode_log_interval: int = _opt(40, "log a decode line every N decode steps")
    enable_metrics: bool = _opt(False, "serve Prometheus /metrics")
    enable_mfu_metrics: bool = _opt(False, "count estimated FLOPs and bytes moved")
    metrics_port: int = _opt(0, "port of this process's /metrics (0: a free port)")
    engine_replica: str = _opt("0", "engine replica name (metrics label)")
    otlp_traces_endpoint: str = _opt(
        "", "OTLP/gRPC endpoint for traces, e.g. localhost:4317 (off when empty)"
    )
    log_level: str = _opt("info", "logging level", choices=["debug", "info", "warning", "error"])

    def __post_init__(self) -> None:
        check_tls_files(self, "control_")
        check_bounds(self)


@dataclass(frozen=True)
class FrontendConfig:
    model_path: str = _opt(
        DEFAULT_MODEL_PATH, "HF-format model folder (tokenizer and chat template)"
    )
    served_model_name: str = _opt("", "model id reported to clients (default: the folder's name)")
    host: str = _opt("127.0.0.1", "interface the public servers bind (0.0.0.0 in a container)")
    port: int = _opt(30000, "public gRPC port")
    http_port: int = _opt(30080, "OpenAI-compatible HTTP port (-1: off)")
    ssl_certfile: str = _opt(
        "", "PEM certificate (chain) of the public gRPC and HTTP ports (TLS); empty: plaintext"
    )
    ssl_keyfile: str = _opt("", "PEM private key of --ssl-certfile")
    ssl_ca_certs: str = _opt(
        "",
        "PEM CA bundle of client certificates: with it, every public gRPC and HTTP client "
        "must present a certificate it signed (mutual TLS); needs --ssl-certfile",
    )
    scheduler_addrs: list[str] = _opt(
        [], "ZeroMQ addresses of the engine schedulers (comma separated)"
    )
    scheduler_control_addrs: list[str] = _opt(
        [], "gRPC control addresses of the schedulers, same order"
    )
    engine_dns_name: str = _opt(
        "",
        "DNS name whose A records are the engine replicas (a headless Service), re-resolved "
        "to follow scaling; replaces --scheduler-addrs",
    )
    engine_dns_server: str = _opt(
        "", "DNS server (host:port) to ask for --engine-dns-name (default: the system resolver)"
    )
    engine_zmq_port: int = _opt(30100, "ZeroMQ port of every discovered engine's scheduler")
    engine_control_port: int = _opt(30101, "gRPC control port of every discovered engine")
    engine_resolve_interval: float = _opt(5.0, "seconds between two lookups of --engine-dns-name")
    routing_policy: str = _opt(
        "cache_aware",
        "which engine gets a request (docs/routing.md): cache_aware (the engine whose radix "
        "tree, known from its cache events, holds most of the prompt, unless the loads are "
        "imbalanced; else prefix_hash), prefix_hash (rendezvous hashing of the first 32 "
        "tokens with bounded loads), round_robin, least_load",
        choices="services.frontend.router:policy_names",
    )
    routing_load_factor: float = _opt(
        1.25,
        "prefix_hash (and cache_aware's fallback) bounded loads: an engine takes new requests "
        "while its load is under this factor times the mean (>= 1; larger keeps shared "
        "prefixes on one engine longer)",
        ge=1,
    )
    routing_balance_abs_threshold: int = _opt(
        8,
        "cache_aware: an engine whose load (running + waiting requests) exceeds the least "
        "loaded one's by more than this, and --routing-balance-rel-threshold times it, takes "
        "no new request",
        ge=0,
    )
    routing_balance_rel_threshold: float = _opt(
        1.5, "cache_aware: the relative half of the imbalance test (>= 1)", ge=1
    )
    routing_min_match_tokens: int = _opt(
        32,
        "cache_aware: the fewest cached prompt tokens that send a request to the engine "
        "holding the most of them (fewer: prefix_hash decides) (>= 1)",
        ge=1,
    )
    routing_hot_prefix_forks: int = _opt(
        16,
        "cache_aware: a prefix that this many different prompts went on from counts as held "
        "by every engine once one holds it (a shared system prompt: requests behind it spread "
        "by load, each engine computes it once) (0: off)",
        ge=0,
    )
    routing_load_cost_tokens: int = _opt(
        64,
        "cache_aware: cached prompt tokens one more request in an engine's load is worth; "
        "an engine is scored by its matched tokens minus this times its load (0: the most "
        "matched wins whatever the load, short of --routing-balance-*)",
        ge=0,
    )
    max_model_len: int = _opt(0, "context length (0: asked from the engines)")
    tool_call_parser: str = _opt(
        "auto",
        "how the model writes tool calls, read into /v1/chat/completions tool_calls "
        "(docs/tools.md); auto: from the chat template's own call markup (tools are refused "
        "when it shows none)",
        choices="services.frontend.chat_tools:tool_parser_choices",
    )
    reasoning_parser: str = _opt(
        "none",
        "split a thinking model's <think>...</think> off into reasoning_content "
        "(docs/tools.md); none: the whole answer is content",
        choices="services.frontend.chat_tools:reasoning_parser_choices",
    )
    max_request_bytes: int = _opt(
        8 << 20, "HTTP request bodies larger than this are refused with 413 before parsing"
    )
    request_body_timeout: float = _opt(
        30.0, "seconds an HTTP client has to send its whole body (then 408)"
    )
    api_key: str = _secret(
        "key every public HTTP route and gRPC call must send as `Authorization: Bearer <key>` "
        "(health probes excepted); empty: no authentication. Env: RADIXSERVE_API_KEY"
    )
    admin_api_key: str = _secret(
        "key of the admin routes and RPCs (flush cache); empty: they take --api-key. "
        "Env: RADIXSERVE_ADMIN_API_KEY"
    )
    max_concurrent_requests_per_key: int = _opt(
        0,
        "generations one API key (the bearer token sent) may have in flight at once, HTTP and "
        "gRPC together, streams until they end; more are refused at once with 429 / "
        "RESOURCE_EXHAUSTED (a request with n > 1 counts once) (0: no limit)",
        ge=0,
    )
    metrics_auth: bool = _opt(
        True,
        "the HTTP port's /metrics needs the API key too, when one is set (the separate "
        "--metrics-port listener never does: keep it off the public network)",
    )
    internal_keys_dir: str = _opt("", _KEYS_DIR_HELP)
    insecure_internal: bool = _opt(False, _INSECURE_HELP)
    control_ssl_ca_certs: str = _opt(
        "",
        "PEM CA bundle that the schedulers' control gRPC certificates are checked by: the "
        "control calls go over TLS (the schedulers need --control-ssl-certfile); empty: "
        "plaintext",
    )
    control_ssl_server_name: str = _opt(
        "",
        "name the control certificates must carry (default: the host of each control "
        "address; discovered engines are IP addresses, so set it to the certificate's DNS name)",
    )
    shutdown_grace_period: float = _opt(
        30.0,
        "on SIGTERM: NOT_SERVING and no new requests at once, then running gRPC and HTTP "
        "streams get this many seconds to finish",
    )
    enable_metrics: bool = _opt(False, "serve Prometheus /metrics")
    metrics_port: int = _opt(0, "port of this process's /metrics (0: a free port)")
    otlp_traces_endpoint: str = _opt(
        "", "OTLP/gRPC endpoint for traces, e.g. localhost:4317 (off when empty)"
    )
    log_level: str = _opt("info", "logging level", choices=["debug", "info", "warning", "error"])

    def __post_init__(self) -> None:
        check_tls_files(self)
        check_tls_files(self, "control_")
        if self.ssl_ca_certs and not self.ssl_certfile:
            raise ValueError("--ssl-ca-certs (client certificates) needs --ssl-certfile")
        check_bounds(self)


@dataclass(frozen=True)
class ServeConfig:
    """`radixserve serve` only: how it supervises its three children."""

    on_child_exit: str = _opt(
        "restart",
        "when a service dies after start-up: restart it (its in-flight requests fail fast "
        "with UNAVAILABLE) or stop all three (the old behaviour)",
        choices=["restart", "stop"],
    )
    max_restarts: int = _opt(
        5, "crash-loop limit: more restarts than this within --restart-window stops all", ge=0
    )
    restart_window: float = _opt(60.0, "seconds over which --max-restarts is counted", gt=0)
    restart_backoff: float = _opt(
        1.0,
        "delay before a restart, doubled for each earlier restart in the window (max 30 s)",
        ge=0,
    )

    def __post_init__(self) -> None:
        check_bounds(self)


def _base_type(tp) -> type:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return origin or tp


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def field_error(f: dataclasses.Field, value) -> str | None:
    """Why ``value`` is out of ``f``'s bounds (None: it is not); a bounded float must also be
    finite (NaN and infinity are typos, not settings)."""
    ge, gt, le = f.metadata.get("ge"), f.metadata.get("gt"), f.metadata.get("le")
    if ge is None and gt is None and le is None:
        return None
    finite = not (isinstance(value, float) and not math.isfinite(value))
    if finite and le is not None and value > le:
        bound = f"<= {le}"  # the bound it broke
    elif finite and (ge is None or value >= ge) and (gt is None or value > gt):
        return None
    else:
        bound = f">= {ge}" if ge is not None else f"> {gt}" if gt is not None else f"<= {le}"
    return f"must be a finite number {bound}" if isinstance(value, float) else f"must be {bound}"


def check_bounds(cfg) -> None:
    """Each field of ``cfg`` within its bounds, else ValueError naming the flag."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        why = field_error(f, value)
        if why is not None:
            raise ValueError(f"--{f.name.replace('_', '-')} {why}, got {value}")


# Where add_dataclass_args leaves refused RADIXSERVE_* values for from_args, per subcommand,
# so a bad worker variable neither stops nor is blamed on another subcommand.
_ENV_ERRORS = "_radixserve_env_errors"


def _env_default(f: dataclasses.Field, default, tp: type, errors: list[str]):
    """The default from RADIXSERVE_<NAME>, held to the flag's type, choices and bounds (argparse
    checks none on a default); a bad value goes to ``errors`` and the default stays."""
    var = ENV_PREFIX + f.name.upper()
    raw = os.environ.get(var)
    if raw is None:
        return default
    why: str | None = None
    value: object
    if tp is bool:
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            why = f"expected one of {', '.join(_TRUE + _FALSE[:-1])}"
        value = word in _TRUE
    elif tp is list:
        value = [s for s in raw.split(",") if s]
    else:
        try:
            value = tp(raw)
        except ValueError:
            why = f"not a valid {tp.__name__}"
        else:
            choices = resolve_choices(f.metadata.get("choices"))
            if choices is not None and value not in choices:
                why = f"must be one of {', '.join(map(str, choices))}"
            else:
                why = field_error(f, value)
    if why is not None:
        errors.append(f"{var}={raw!r}: {why}")
        return default
    return value


def resolve_choices(spec):
    """A list, or "module:function" naming the registry that lists the names."""
    if isinstance(spec, str):
        module, fn = spec.split(":")
        return getattr(importlib.import_module(module), fn)()
    return spec


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, seen: set[str] | None = None
) -> None:
    """Adds one ``--flag`` per field of ``cls``; names already in ``seen`` are skipped."""
    seen = set() if seen is None else seen
    errors: list[str] = parser.get_default(_ENV_ERRORS) or []
    parser.set_defaults(**{_ENV_ERRORS: errors})
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in seen:
            continue
        seen.add(f.name)
        tp = _base_type(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            raise TypeError(f"{cls.__name__}.{f.name} has no default")
        if not f.metadata.get("secret"):  # a secret's env is read in from_args, off --help
            default = _env_default(f, default, tp, errors)
        flag = "--" + f.name.replace("_", "-")
        kw = {"help": f.metadata.get("help", ""), "default": default}
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif tp is list:
            parser.add_argument(flag, type=lambda s: [x for x in s.split(",") if x], **kw)
        else:
            parser.add_argument(
                flag, type=tp, choices=resolve_choices(f.metadata.get("choices")), **kw
            )


def from_args(cls: type, ns: argparse.Namespace, **overrides):
    """Builds ``cls`` from parsed arguments (others ignored); ValueError, a line per fault,
    when a RADIXSERVE_* variable that fed them or a field is out of bounds."""
    if errors := getattr(ns, _ENV_ERRORS, None):
        raise ValueError("\n".join(errors))
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in vars(ns).items() if k in names}
    for f in dataclasses.fields(cls):
        if f.metadata.get("secret") and not values.get(f.name):
            values[f.name] = os.environ.get(ENV_PREFIX + f.name.upper(), "")
    values.update(overrides)
    return cls(**values)


def secret_env(cfg) -> dict[str, str]:
    """``cfg``'s secrets as a child's environment (to_argv omits them: argv is public)."""
    return {
        ENV_PREFIX + f.name.upper(): getattr(cfg, f.name)
        for f in dataclasses.fields(cfg)
        if f.metadata.get("secret") and getattr(cfg, f.name)
    }


def to_argv(cfg) -> list[str]:
    """The flags that rebuild ``cfg`` in a child process (inverse of from_args)."""
    argv: list[str] = []
    for f in dataclasses.fields(cfg):
        if f.metadata.get("secret"):
            continue  # through secret_env instead
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, ",".join(value)]
        else:
            argv += [flag, str(value)]
    return argv


def exit_usage(prog: str, error: ValueError) -> typing.NoReturn:
    """Ends like argparse on a bad command line (status 2): "<prog>: <why>" per fault."""
    for line in str(error).splitlines():
        print(f"{prog}: {line}", file=sys.stderr)
    raise SystemExit(2)
