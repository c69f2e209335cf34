"""The worker's engine: a Batch in, one sampled token per request out (for a request with
drafts, the confirmed drafts plus its next token).

It owns the model, KV pool, request-slot table and sampler, but schedules nothing: every
KV slot and table row it touches is one the batch names. Protobuf stays in wire.py.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig

from services.common.config import WorkerConfig
from services.worker import prompt_logprobs
from services.worker.attention.base import AttentionBackend, AttentionMeta, get_backend
from services.worker.batch import (
    Batch,
    ForwardOutput,
    RunnerInfo,
    Scored,
    SlotStart,
)
from services.worker.cuda_graph import CudaGraphRunner, capture_sizes
from services.worker.grammar import Grammars
from services.worker.host_pool import HostPool, host_tier_tokens
from services.worker.kv_pool import (
    DEFAULT_MEM_FRACTION,
    KVPool,
    KVShape,
    RuntimeReserve,
    pool_size_tokens,
)
from services.worker.model_loader import (
    architecture_of,
    eos_token_ids,
    load_config,
    load_model,
    num_parameters,
    pack_for_cpu,
    resolve_dtype,
    safetensors_files,
    weight_nbytes,
    weights_fingerprint,
)
from services.worker.models.llama import head_dim_of
from services.worker.page_store import DirectoryBackend, PageBackend, PageStore
from services.worker.parallel.group import TpGroup
from services.worker.parallel.launch import EXIT_RANK_LOST
from services.worker.parallel.rank_runner import RankShape, make_step
from services.worker.parallel.shard_model import check_shardable, load_rank_model, local_heads
from services.worker.parallel.step_channel import LeadChannel, Op
from services.worker.req_table import ReqToTokenTable
from services.worker.sampling import Sampler
from services.worker.step_inputs import StepStager

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def backend_class(name: str, device: torch.device) -> type[AttentionBackend]:
    """The backend class for --attention-backend ("auto": triton on cuda, torch on cpu)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    # Importing a backend module registers it; triton's is optional.
    importlib.import_module("services.worker.attention.torch_backend")
    if name == "triton":
        importlib.import_module("services.worker.attention.triton_backend")
    return get_backend(name)


def _context_length(cfg: WorkerConfig, c: PretrainedConfig) -> int:
    """--context-length or the model's, capped at its sliding window: attention here is full,
    exact only while the context fits the window."""
    length = cfg.context_length or c.max_position_embeddings
    window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None
    if window and length > window:
        log.warning(
            "context length capped at the sliding window (%d tokens; "
            "full attention beyond is not implemented)",
            window,
        )
        return int(window)
    return int(length)


def check_tensor_parallel(cfg: WorkerConfig, c: PretrainedConfig, device: torch.device) -> None:
    """Refuses, before any rank starts, what --tp-size cannot run (ValueError, named)."""
    n = cfg.tp_size
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(f"--tp-size {n} needs {n} GPUs; CUDA shows {torch.cuda.device_count()}")
    if cfg.hicache_ratio or cfg.hicache_size:
        raise ValueError(
            "the hierarchical cache (--hicache-ratio / --hicache-size) is not split across "
            "tensor-parallel ranks yet; run it with --tp-size 1"
        )
    check_shardable(c, TpGroup(rank=0, world=n))  # heads, kv heads, intermediate, AWQ


class ModelRunner:
    """``tp``: rank 0's group under tensor parallelism (docs/tensor-parallel.md): this rank
    holds its shard, sends every step to the others before running it, and alone samples."""

    def __init__(self, cfg: WorkerConfig, tp: TpGroup | None = None):
        self.cfg = cfg
        self.tp = tp if tp is not None else TpGroup()
        self.lead = LeadChannel(self.tp) if self.tp.world > 1 else None
        self.device = resolve_device(cfg.device)
        self.model_path = cfg.model_path
        self.hf_config = c = load_config(cfg.model_path)
        self.dtype = resolve_dtype(cfg.dtype, c, self.device)
        if self.tp.world > 1:
            check_tensor_parallel(cfg, c, self.device)
        self.model = self._load_model(c)
        self.weights_fingerprint = weights_fingerprint(safetensors_files(cfg.model_path))
        self.vocab_size = c.vocab_size
        self.max_context = _context_length(cfg, c)
        self.num_kv_heads = c.num_key_value_heads or c.num_attention_heads
        self.local_heads, self.local_kv_heads = local_heads(c, self.tp)  # this rank's
        self.head_dim = head_dim_of(c)
        self.num_parameters = num_parameters(self.model)
        self.kv_pool = self._make_pool()
        self.host_pool = self._make_host_pool()
        self.packed_linears = pack_for_cpu(self.model, cfg.cpu_linear, self.device)
        self.num_slots = self.kv_pool.num_slots
        cls = backend_class(cfg.attention_backend, self.device)
        self.backend_name = cls.name
        scale = self.head_dim**-0.5
        backend = cls(self.local_heads, self.local_kv_heads, self.head_dim, scale)
        self.model.attach(backend, self.kv_pool)
        self.table = ReqToTokenTable(cfg.max_running_requests, self.max_context, self.device)
        self.stager = StepStager(self.device)
        self.sampler = Sampler(
            cfg.max_running_requests, self.vocab_size, self.device, cfg.random_seed
        )
        self.eos_token_ids = eos_token_ids(cfg.model_path, c)
        self.grammars = Grammars(cfg, self.vocab_size, list(self.eos_token_ids))
        self.graphs = self._capture_graphs(cfg)
        # The last token sampled per request slot: the input of an overlap-scheduled decode.
        self.last_sampled = np.full(cfg.max_running_requests, -1, dtype=np.int64)
        self._logged_eager_verify = False
        self._in_step = False  # under TP: the other ranks are inside this step's collectives
        self._info = self._make_info()
        if self.lead is not None:  # the others load their shards meanwhile, then size alike
            RankShape(self.num_slots, cfg.max_running_requests, self.max_context).send(self.lead)
        log.info(
            "worker ready: %d KV slots (%.1f MiB), backend %s, %s on %s",
            self.num_slots,
            self.kv_pool.nbytes() / 2**20,
            self.backend_name,
            self.dtype,
            self.device,
        )

    def _load_model(self, c: PretrainedConfig):
        if self.tp.world == 1:
            return load_model(self.cfg.model_path, self.dtype, self.device, config=c)[0]
        model, read = load_rank_model(self.cfg.model_path, c, self.dtype, self.device, self.tp)
        log.info(
            "tensor parallelism: rank 0 of %d, %.1f MiB of the checkpoint read",
            self.tp.world,
            read / 2**20,
        )
        return model

    def _make_pool(self) -> KVPool:
        """As many KV slots as the memory share allows; under TP on CPU the ranks share the
        host's memory, so each takes 1/N of the share."""
        c, cfg = self.hf_config, self.cfg
        shape = KVShape(c.num_hidden_layers, self.local_kv_heads, self.head_dim, self.dtype)
        weight_bytes = weight_nbytes(self.model)  # parameters + AWQ's packed buffers
        fraction = cfg.mem_fraction_static
        if self.tp.world > 1 and self.device.type == "cpu":
            fraction = (fraction or DEFAULT_MEM_FRACTION.get("cpu", 0.3)) / self.tp.world
        num_slots = pool_size_tokens(
            shape,
            self.device,
            cfg.max_total_tokens,
            fraction,
            weight_bytes,
            cap_tokens=cfg.max_running_requests * self.max_context,
            reserve=self._runtime_reserve(),
        )
        start = time.perf_counter()
        pool = KVPool(shape, num_slots, self.device)
        seconds = time.perf_counter() - start
        log.info("KV pool of %.2f GiB zeroed in %.1f s", pool.nbytes() / 2**30, seconds)
        return pool

    def _make_host_pool(self) -> HostPool | None:
        cfg, shape = self.cfg, self.kv_pool.shape
        slots = host_tier_tokens(shape, self.kv_pool.num_slots, cfg.hicache_ratio, cfg.hicache_size)
        flag = "--hicache-storage-dir" if cfg.hicache_storage_dir else "--hicache-storage-url"
        wants_store = bool(cfg.hicache_storage_dir or cfg.hicache_storage_url)
        if slots <= 0:
            if wants_store:
                raise ValueError(f"{flag} needs the host tier: set --hicache-ratio")
            return None
        store = None
        if wants_store:
            if cfg.hicache_storage_page_tokens < 1:
                raise ValueError("--hicache-storage-page-tokens must be >= 1")
            store = PageStore(self._page_backend(), shape, cfg.hicache_storage_page_tokens)
            log.info(
                "storage tier: pages of %d tokens in %s", store.page_tokens, store.backend.where
            )
        pool = HostPool(shape, slots, pin=self.device.type == "cuda", store=store)
        log.info("host tier: %d KV slots (%.2f GiB)", slots, pool.nbytes() / 2**30)
        return pool

    def _page_backend(self) -> PageBackend:
        cfg = self.cfg
        if cfg.hicache_storage_dir:
            return DirectoryBackend(cfg.hicache_storage_dir)
        from services.worker.redis_store import RedisBackend  # redis only where it is used

        return RedisBackend(
            cfg.hicache_storage_url,
            ttl=cfg.hicache_storage_ttl,
            timeout=cfg.hicache_storage_timeout_ms / 1000,
            password=cfg.hicache_storage_password,
            tls_ca=cfg.hicache_storage_tls_ca,
        )

    def copy_kv(self, copies: list) -> list[tuple[int, int]]:
        """Copies between the tiers; returns (load_id, pages) of each storage load."""
        if self.host_pool is None:
            raise ValueError("this worker has no host tier (--hicache-ratio / --hicache-size)")
        return self.host_pool.apply(copies, self.kv_pool)

    def _runtime_reserve(self) -> RuntimeReserve:
        c, cfg = self.hf_config, self.cfg
        graphs = self.device.type == "cuda" and not cfg.disable_cuda_graph
        max_bs = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
        return RuntimeReserve(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            qkv_size=(self.local_heads + 2 * self.local_kv_heads) * self.head_dim,
            vocab_size=self.vocab_size,
            dtype=self.dtype,
            max_running_requests=cfg.max_running_requests,
            graph_batch_rows=sum(capture_sizes(max_bs)) if graphs and max_bs >= 1 else 0,
        )

    def _capture_graphs(self, cfg: WorkerConfig) -> CudaGraphRunner | None:
        """Decode CUDA graphs; needs a backend reading per-step sizes on device (triton)."""
        if self.device.type != "cuda" or cfg.disable_cuda_graph or self.backend_name != "triton":
            return None
        if self.tp.world > 1:
            log.info(
                "CUDA graphs are off under --tp-size %d: the all-reduces are not captured in "
                "graphs yet, so decode runs eagerly",
                self.tp.world,
            )
            return None
        max_bs = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
        return CudaGraphRunner(self.model, max_bs, self.table, self.device)

    def info(self) -> RunnerInfo:
        return self._info

    def forget_requests(self) -> None:
        """A new scheduler took over: clears what a request's first batch would not rewrite."""
        self.last_sampled.fill(-1)
        self.grammars.waits.clear()

    def _make_info(self) -> RunnerInfo:
        c = self.hf_config
        return RunnerInfo(
            model_id=self.cfg.served_model_name or Path(self.model_path).name,
            architecture=architecture_of(c),
            vocab_size=self.vocab_size,
            max_model_len=self.max_context,
            max_total_num_tokens=self.num_slots,
            max_running_requests=self.cfg.max_running_requests,
            device=str(self.device),
            dtype=_DTYPE_NAMES[self.dtype],
            attention_backend=self.backend_name,
            num_parameters=self.num_parameters,
            num_layers=c.num_hidden_layers,
            hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            intermediate_size=c.intermediate_size,
            eos_token_ids=list(self.eos_token_ids),
            host_total_num_tokens=self.host_pool.num_slots if self.host_pool else 0,
            storage_page_tokens=self.host_pool.page_tokens if self.host_pool else 0,
            weights_fingerprint=self.weights_fingerprint,
        )

    def forward(self, batch: Batch) -> ForwardOutput:
        """Runs one batch (checked by wire.py). Raises ValueError, nothing written, when it
        names a slot whose state this worker lacks."""
        start = time.perf_counter()
        if not batch.reqs:
            return ForwardOutput([], [], [])
        self._in_step = False
        try:
            out = self._forward(batch)
        except Exception as e:
            if self._in_step:  # the ranks' collectives are out of step: none can go on
                log.critical(
                    "tensor parallelism: a step failed midway (%s: %s; a rank died or hung?); "
                    "the engine goes down so that its supervisor restarts every rank",
                    type(e).__name__,
                    e,
                )
                os._exit(EXIT_RANK_LOST)
            raise
        out.forward_time = time.perf_counter() - start
        return out

    def _forward(self, batch: Batch) -> ForwardOutput:
        sampled = [i for i, r in enumerate(batch.reqs) if r.sample]
        rows = self._logit_rows(batch, sampled)  # host; None without TP (found on the device)
        input_ids, positions, meta = self._begin(batch, rows)
        logits, graphed, hidden = self._sampled_logits(
            batch, sampled, input_ids, positions, meta, rows
        )
        self._in_step = False  # every rank is through the step's collectives
        out = self._sample(batch, sampled, logits)
        if batch.has_drafts and not self._logged_eager_verify and self.graphs is not None:
            # Verify rows vary step to step; a graph replays fixed shapes.
            log.info("verify steps (speculative decoding) run eagerly, outside CUDA graphs")
            self._logged_eager_verify = True
        if not batch.is_decode and any(r.score is not None for r in batch.reqs):
            assert hidden is not None  # only decode steps replay graphs
            out.prompt_logprobs = self._score_prompts(batch, hidden)
        out.cuda_graph = graphed
        return out

    def logits(self, batch: Batch) -> torch.Tensor:
        """Like forward, eager, but returns [T, vocab] float32 logits and samples nothing."""
        rows = np.arange(sum(r.n_new for r in batch.reqs)) if self.lead is not None else None
        input_ids, positions, meta = self._begin(batch, rows)
        return self.model.compute_logits(self.model.forward(input_ids, positions, meta))

    def _begin(
        self, batch: Batch, rows: np.ndarray | None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMeta]:
        """Checks the batch, updates sampling state and table; returns the model inputs."""
        ids = self._input_ids(batch)
        self._start_slots(batch)
        if self.lead is not None:
            assert rows is not None
            self._send_step(batch, ids, rows)
        return self._prepare(batch, ids)

    def _logit_rows(self, batch: Batch, sampled: list[int]) -> np.ndarray | None:
        """Under TP, the logit rows, known on the host before the forward (all ranks gather)."""
        if self.lead is None:
            return None
        if batch.has_drafts:
            return self._verify_rows(batch, sampled).numpy()
        return np.cumsum([r.n_new for r in batch.reqs], dtype=np.int64)[sampled] - 1

    def _send_step(self, batch: Batch, ids: list[np.ndarray], rows: np.ndarray) -> None:
        assert self.lead is not None
        prefixes = [
            (r.req_slot, np.asarray(r.start.prefix_slots, dtype=np.int64))
            for r in batch.reqs
            if r.start is not None and r.prefix_len > 0
        ]
        step = make_step(
            ids,
            [r.out_slots for r in batch.reqs],
            [r.req_slot for r in batch.reqs],
            [r.prefix_len for r in batch.reqs],
            batch.is_decode,
            rows,
            prefixes,
        )
        self._in_step = True
        step.send(self.lead)

    def ping_ranks(self) -> None:
        """Under TP, while idle: keeps the other ranks' wait from timing out (--tp-timeout)."""
        if self.lead is not None:
            self.lead.ping_if_idle(min(30.0, self.cfg.tp_timeout / 4))

    def stop_ranks(self) -> None:
        if self.lead is not None:
            self.lead.send(Op.STOP, [], [])

    def _input_ids(self, batch: Batch) -> list[np.ndarray]:
        """Each request's new tokens, then its drafts."""
        ids = []
        for r in batch.reqs:
            if r.start is None and not self.sampler.has_state(r.req_slot):
                raise ValueError(f"{r.where}: req_slot was never started (is_new not set)")
            if r.drafts is not None:
                ids.append(np.concatenate([r.input_ids, r.drafts]))
                continue
            if not r.use_last_sampled:
                ids.append(r.input_ids)
                continue
            last = int(self.last_sampled[r.req_slot])
            if last < 0:
                raise ValueError(
                    f"{r.where}: use_last_sampled needs empty input_ids and a token sampled before"
                )
            ids.append(np.array([last], dtype=np.int32))
        return ids

    def _start_slots(self, batch: Batch) -> None:
        for r in batch.reqs:
            if r.start is None:
                continue
            self.sampler.reset_slot(
                r.req_slot, r.start.sampling, self._generated(r.req_slot, r.start)
            )
            self._start_grammar(r.req_slot, r.start)
            if not r.start.keep_last_sampled:
                self.last_sampled[r.req_slot] = -1

    def _generated(self, slot: int, start: SlotStart) -> np.ndarray:
        """Tokens generated so far, including under overlap scheduling the one sampled but not
        yet seen by the scheduler (penalties, seeded draws and min_tokens count it)."""
        if start.keep_last_sampled and self.last_sampled[slot] >= 0:
            last = np.array([self.last_sampled[slot]], dtype=np.int32)
            return np.concatenate([start.output_ids.astype(np.int32), last])
        return start.output_ids

    def _start_grammar(self, slot: int, start: SlotStart) -> None:
        """The slot's matcher, replaying the tokens generated so far (as _generated)."""
        replay = start.output_ids.tolist()
        if start.keep_last_sampled and self.last_sampled[slot] >= 0:
            replay.append(int(self.last_sampled[slot]))
        self.grammars.slots.start(slot, start.constraint, replay)

    def _prepare(
        self, batch: Batch, ids: list[np.ndarray]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMeta]:
        """Writes the table rows and builds the batch's tensors in one host-to-device copy."""
        self._write_prefixes(batch)
        step = self.stager.stage(
            ids,
            [r.out_slots for r in batch.reqs],
            [r.req_slot for r in batch.reqs],
            [r.prefix_len for r in batch.reqs],
        )
        self.table.write_tokens(step.token_rows, step.positions, step.out_slots)
        return (
            step.input_ids,
            step.positions,
            step.attention_meta(batch.is_decode, self.table.table),
        )

    def _write_prefixes(self, batch: Batch) -> None:
        for r in batch.reqs:
            if r.start is not None and r.prefix_len > 0:
                self.table.write_prefix(r.req_slot, torch.tensor(r.start.prefix_slots))

    def _sampled_logits(
        self,
        batch: Batch,
        sampled: list[int],
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMeta,
        rows: np.ndarray | None,
    ) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        """(logits [n, vocab] of each sampled request's last token, or last 1 + k with k
        drafts; whether a CUDA graph ran; hidden [T, hidden] when eager)."""
        if batch.is_decode and self.graphs is not None and self.graphs.can_run(len(batch.reqs)):
            return self.graphs.replay(input_ids, positions, meta)[sampled], True, None
        hidden = self.model.forward(input_ids, positions, meta)  # [T, hidden]
        if rows is not None:
            return self._rows_logits(hidden, rows), False, hidden
        if batch.has_drafts:
            last_rows = self._verify_rows(batch, sampled).to(hidden.device)  # [n + drafts]
        else:
            last_rows = meta.qo_indptr[1:].long()[sampled] - 1  # [n]
        return self.model.compute_logits(hidden[last_rows]), False, hidden

    @staticmethod
    def _verify_rows(batch: Batch, sampled: list[int]) -> torch.Tensor:
        """Host-side hidden-state rows to score: per sampled request its last 1 + k."""
        ends = np.cumsum([r.n_new for r in batch.reqs])  # one past each request's last row
        rows = []
        for i in sampled:
            drafts = batch.reqs[i].drafts
            k = 0 if drafts is None else len(drafts)
            rows.append(np.arange(ends[i] - 1 - k, ends[i]))
        return torch.from_numpy(np.concatenate(rows).astype(np.int64))

    def _score_prompts(self, batch: Batch, hidden: torch.Tensor) -> list[list[Scored] | None]:
        starts = np.cumsum([0] + [len(r.out_slots) for r in batch.reqs[:-1]]).tolist()
        asks = [r.score for r in batch.reqs]
        # Fits the sampler's logits reserve (kv_pool.RuntimeReserve).
        block = max(16, self.cfg.max_running_requests)

        def logits_of(rows: np.ndarray) -> torch.Tensor:
            if self.lead is not None:  # the other ranks take part in the lm_head's gather
                self.lead.send(Op.LOGITS, [], [rows.astype(np.int64)])
            return self._rows_logits(hidden, rows)

        return prompt_logprobs.score(logits_of, starts, asks, block)

    def _rows_logits(self, hidden: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
        """Logits [len(rows), vocab] float32; no rows skips the lm_head (and TP gather)."""
        if len(rows) == 0:
            return torch.empty(0, self.vocab_size, device=hidden.device)
        index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(hidden.device)
        return self.model.compute_logits(hidden[index])

    def _sample(self, batch: Batch, sampled: list[int], logits: torch.Tensor) -> ForwardOutput:
        """One token per sampled request (plus accepted drafts); -1 for the others."""
        n = len(batch.reqs)
        out = ForwardOutput([-1] * n, [None] * n, [None] * n)
        if not sampled:
            return out
        slots = [batch.reqs[i].req_slot for i in sampled]
        drafts = self._drafts_of(batch, sampled)
        constrained = self.grammars.slots.any_constrained(slots)
        if constrained and drafts is not None:
            logits, drafts = self._mask_verify_rows(logits, slots, drafts)
        elif constrained:
            self.grammars.slots.mask(logits, slots)
        got = self.sampler.sample(logits, slots, drafts=drafts)
        if constrained:
            extras = got.extra_token_ids or [[] for _ in slots]
            committed = [[t, *e] for t, e in zip(got.token_ids, extras, strict=True)]
            self._advance_grammars(out, sampled, slots, committed)
        for j, i in enumerate(sampled):
            out.token_ids[i] = got.token_ids[j]
            out.logprobs[i] = got.logprobs[j]
            out.top_logprobs[i] = got.top_logprobs[j]
        if drafts is None:
            self.last_sampled[slots] = got.token_ids
            return out
        out.extra_token_ids, out.extra_logprobs = [[] for _ in range(n)], [[] for _ in range(n)]
        for j, i in enumerate(sampled):
            out.extra_token_ids[i] = got.extra_token_ids[j]
            out.extra_logprobs[i] = got.extra_logprobs[j]
            self.last_sampled[slots[j]] = (got.extra_token_ids[j] or [got.token_ids[j]])[-1]
        return out

    @staticmethod
    def _drafts_of(batch: Batch, sampled: list[int]) -> list[np.ndarray] | None:
        if not batch.has_drafts:
            return None
        none = np.zeros(0, dtype=np.int32)
        return [d if (d := batch.reqs[i].drafts) is not None else none for i in sampled]

    def _mask_verify_rows(
        self, logits: torch.Tensor, slots: list[int], drafts: list[np.ndarray]
    ) -> tuple[torch.Tensor, list[np.ndarray]]:
        """Grammar-masks verify rows, dropping the rows of drafts the grammar refuses."""
        starts = np.cumsum([0] + [1 + len(d) for d in drafts[:-1]])
        keep, kept = [], []
        for start, slot, d in zip(starts.tolist(), slots, drafts, strict=True):
            rows = logits[start : start + 1 + len(d)]  # a view: masked in place
            n = self.grammars.slots.mask_drafts(rows, slot, d.tolist())
            keep.append(np.arange(start, start + 1 + n))
            kept.append(d[:n])
        index = np.concatenate(keep)
        if len(index) < logits.shape[0]:
            logits = logits[torch.from_numpy(index).to(logits.device)]
        return logits, kept

    def _advance_grammars(
        self, out: ForwardOutput, sampled: list[int], slots: list[int], tokens: list[list[int]]
    ) -> None:
        terminated, errors = self.grammars.slots.advance(slots, tokens)
        n = len(out.token_ids)
        out.grammar_terminated, out.grammar_errors = [False] * n, [""] * n
        out.grammar_dead_ends = [False] * n
        for j, i in enumerate(sampled):
            out.grammar_terminated[i], out.grammar_errors[i] = terminated[j], errors[j]
            out.grammar_dead_ends[i] = self.grammars.slots.dead_end[slots[j]]
