"""The worker's engine: a ForwardBatch in, one sampled token per request out.

It owns the model (with its attention backend and KV pool), the request-slot table and
the sampler. No scheduling happens here: every KV slot and table row it touches is the
one the scheduler named in the batch.
"""

from __future__ import annotations

import importlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from radixserve.internal.v1 import engine_pb2
from services.common.config import WorkerConfig
from services.common.transport import unpack_i32
from services.worker.attention.base import AttentionBackend, AttentionMeta, get_backend
from services.worker.kv_pool import KVPool, KVShape, pool_size_tokens
from services.worker.model_loader import (
    architecture_of,
    eos_token_ids,
    load_config,
    load_model,
    num_parameters,
    resolve_dtype,
)
from services.worker.models.llama import head_dim_of
from services.worker.req_table import ReqToTokenTable, segment_arange
from services.worker.sampling import SampleOutput, Sampler

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
    # Importing a backend module registers it; triton's is optional (another module).
    importlib.import_module("services.worker.attention.torch_backend")
    if name == "triton":
        importlib.import_module("services.worker.attention.triton_backend")
    return get_backend(name)


def _context_length(cfg: WorkerConfig, c) -> int:
    """--context-length or the model's, capped at a sliding window when the model uses one:
    the attention here is full, which is exact only while the context fits the window."""
    length = cfg.context_length or c.max_position_embeddings
    window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None
    if window and length > window:
        log.warning(
            "context length capped at the sliding window (%d tokens; full attention beyond is not implemented)",
            window,
        )
        return int(window)
    return int(length)


@dataclass
class _Req:
    """One ForwardRequest, decoded and checked."""

    req_slot: int
    input_ids: np.ndarray
    out_slots: np.ndarray
    prefix_len: int
    prefix_slots: np.ndarray | None  # only when is_new


class ModelRunner:
    def __init__(self, cfg: WorkerConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.model_path = cfg.model_path
        self.hf_config = load_config(cfg.model_path)
        self.dtype = resolve_dtype(cfg.dtype, self.hf_config, self.device)
        self.model, _ = load_model(cfg.model_path, self.dtype, self.device, config=self.hf_config)
        c = self.hf_config
        self.vocab_size = c.vocab_size
        self.max_context = _context_length(cfg, c)
        self.num_kv_heads = c.num_key_value_heads or c.num_attention_heads
        self.head_dim = head_dim_of(c)
        self.num_parameters = num_parameters(self.model)
        shape = KVShape(c.num_hidden_layers, self.num_kv_heads, self.head_dim, self.dtype)
        weight_bytes = sum(p.nbytes for p in self.model.parameters())
        self.num_slots = pool_size_tokens(
            shape,
            self.device,
            cfg.max_total_tokens,
            cfg.mem_fraction_static,
            weight_bytes,
            cap_tokens=cfg.max_running_requests * self.max_context,
        )
        self.kv_pool = KVPool(shape, self.num_slots, self.device)
        cls = backend_class(cfg.attention_backend, self.device)
        self.backend_name = cls.name
        backend = cls(c.num_attention_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.model.attach(backend, self.kv_pool)
        self.table = ReqToTokenTable(cfg.max_running_requests, self.max_context, self.device)
        self.sampler = Sampler(
            cfg.max_running_requests, self.vocab_size, self.device, cfg.random_seed
        )
        self.eos_token_ids = eos_token_ids(cfg.model_path, c)
        self.graphs = self._capture_graphs(cfg)
        # The last token sampled per request slot: the input of an overlap-scheduled decode.
        self.last_sampled = np.full(cfg.max_running_requests, -1, dtype=np.int64)
        log.info(
            "worker ready: %d KV slots (%.1f MiB), backend %s, %s on %s",
            self.num_slots,
            self.kv_pool.nbytes() / 2**20,
            self.backend_name,
            self.dtype,
            self.device,
        )

    def _capture_graphs(self, cfg: WorkerConfig):
        """Decode CUDA graphs (services/worker/cuda_graph.py) when on CUDA with a backend
        that reads every per-step size from device buffers (triton)."""
        if self.device.type != "cuda" or cfg.disable_cuda_graph or self.backend_name != "triton":
            return None
        from services.worker.cuda_graph import CudaGraphRunner

        max_bs = min(cfg.cuda_graph_max_bs, cfg.max_running_requests)
        return CudaGraphRunner(self.model, max_bs, self.max_context, self.device)

    # ---- info -----------------------------------------------------------------------

    def info(self) -> engine_pb2.WorkerInfo:
        c = self.hf_config
        return engine_pb2.WorkerInfo(
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
            eos_token_ids=self.eos_token_ids,
        )

    # ---- forward --------------------------------------------------------------------

    def forward(self, batch: engine_pb2.ForwardBatch) -> engine_pb2.ForwardResult:
        """Runs one batch. Raises ValueError (nothing written) when the batch is malformed."""
        start = time.perf_counter()
        result = engine_pb2.ForwardResult(batch_id=batch.batch_id)
        if not batch.reqs:
            return result
        reqs, input_ids, positions, meta = self._begin(batch)
        sampled = [i for i, msg in enumerate(batch.reqs) if msg.sample]
        if batch.is_decode and self.graphs is not None and self.graphs.can_run(len(reqs)):
            logits = self.graphs.replay(input_ids, positions, meta)[sampled]  # [n, vocab]
            result.cuda_graph = True
        else:
            hidden = self.model.forward(input_ids, positions, meta)
            last_rows = meta.qo_indptr[1:].long()[sampled] - 1
            logits = self.model.compute_logits(hidden[last_rows])  # [n, vocab]
        tokens = [engine_pb2.SampledToken(token_id=-1) for _ in reqs]
        if sampled:
            out = self.sampler.sample(
                logits,
                [reqs[i].req_slot for i in sampled],
                [batch.reqs[i].allowed_token_mask for i in sampled],
            )
            for j, i in enumerate(sampled):
                tokens[i] = _sampled_token(out, j)
                self.last_sampled[reqs[i].req_slot] = out.token_ids[j]
        result.tokens.extend(tokens)
        result.forward_time = time.perf_counter() - start
        return result

    def logits(self, batch: engine_pb2.ForwardBatch) -> torch.Tensor:
        """Like forward (KV written, table updated, eager) but returns the logits of every
        new token, [T, vocab] float32, and samples nothing. For tests and debugging."""
        _, input_ids, positions, meta = self._begin(batch)
        return self.model.compute_logits(self.model.forward(input_ids, positions, meta))

    def _begin(
        self, batch: engine_pb2.ForwardBatch
    ) -> tuple[list[_Req], torch.Tensor, torch.Tensor, AttentionMeta]:
        """Checks the whole batch, then updates sampling state and the table; the model inputs."""
        reqs = [self._parse(r, batch.is_decode) for r in batch.reqs]
        self._check_batch(reqs)
        for r, msg in zip(reqs, batch.reqs, strict=True):
            if msg.is_new:
                params = msg.sampling if msg.HasField("sampling") else None
                self.sampler.reset_slot(r.req_slot, params, unpack_i32(msg.output_ids))
                if not msg.use_last_sampled:  # a new owner of the slot: forget the old token
                    self.last_sampled[r.req_slot] = -1
        return (reqs, *self._prepare(reqs, batch.is_decode))

    def _parse(self, msg: engine_pb2.ForwardRequest, is_decode: bool) -> _Req:
        where = f"request {msg.rid or '?'} (req_slot {msg.req_slot})"
        if not 0 <= msg.req_slot < self.cfg.max_running_requests:
            raise ValueError(f"{where}: req_slot out of range [0, {self.cfg.max_running_requests})")
        ids, out_slots = unpack_i32(msg.input_ids), unpack_i32(msg.out_slots)
        if msg.use_last_sampled:
            last = int(self.last_sampled[msg.req_slot])
            if last < 0 or len(ids):
                raise ValueError(
                    f"{where}: use_last_sampled needs empty input_ids and a token sampled before"
                )
            ids = np.array([last], dtype=np.int32)
        if len(ids) == 0:
            raise ValueError(f"{where}: no input_ids")
        if len(out_slots) != len(ids):
            raise ValueError(f"{where}: {len(out_slots)} out_slots for {len(ids)} input_ids")
        if is_decode and len(ids) != 1:
            raise ValueError(f"{where}: a decode batch carries 1 token per request, got {len(ids)}")
        if msg.prefix_len < 0 or msg.prefix_len + len(ids) > self.max_context:
            raise ValueError(
                f"{where}: prefix_len {msg.prefix_len} + {len(ids)} new tokens exceeds the context length {self.max_context}"
            )
        prefix_slots = None
        if msg.is_new:
            prefix_slots = unpack_i32(msg.prefix_slots)
            if len(prefix_slots) != msg.prefix_len:
                raise ValueError(
                    f"{where}: {len(prefix_slots)} prefix_slots for prefix_len {msg.prefix_len}"
                )
        elif not self.sampler.has_state(msg.req_slot):
            raise ValueError(f"{where}: req_slot was never started (is_new not set)")
        return _Req(msg.req_slot, ids, out_slots, msg.prefix_len, prefix_slots)

    def _check_batch(self, reqs: list[_Req]) -> None:
        slots = [r.req_slot for r in reqs]
        if len(set(slots)) != len(slots):
            raise ValueError("a req_slot appears twice in one batch")
        ids = np.concatenate([r.input_ids for r in reqs])
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise ValueError(f"input_ids out of the vocabulary [0, {self.vocab_size})")
        kv = np.concatenate(
            [r.out_slots for r in reqs]
            + [r.prefix_slots for r in reqs if r.prefix_slots is not None]
        )
        if kv.min() < 1 or kv.max() > self.num_slots:
            raise ValueError(f"KV slot out of range [1, {self.num_slots}] (slot 0 is padding)")

    def _prepare(
        self, reqs: list[_Req], is_decode: bool
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMeta]:
        """Writes the table rows and builds the batch's tensors (vectorised over tokens).

        Index arithmetic runs on the host (no device sync for sizes); only the results move."""
        dev = self.device

        def host(values) -> torch.Tensor:
            return torch.from_numpy(np.asarray(values, dtype=np.int64))

        req_slots = host([r.req_slot for r in reqs])
        prefix_lens = host([r.prefix_len for r in reqs])
        extend_lens = host([len(r.input_ids) for r in reqs])
        seq_lens = prefix_lens + extend_lens
        new = [i for i, r in enumerate(reqs) if r.prefix_slots is not None and r.prefix_len > 0]
        if new:
            prefix_slots = host(np.concatenate([reqs[i].prefix_slots for i in new]))
            self.table.write(
                req_slots[new],
                torch.zeros(len(new), dtype=torch.int64),
                prefix_lens[new],
                prefix_slots.to(dev),
            )
        out_slots = host(np.concatenate([r.out_slots for r in reqs])).to(dev)
        self.table.write(req_slots, prefix_lens, extend_lens, out_slots)
        zero = torch.zeros(1, dtype=torch.int64)
        meta = AttentionMeta(
            is_decode=is_decode,
            out_slots=out_slots,
            qo_indptr=torch.cat([zero, torch.cumsum(extend_lens, 0)]).int().to(dev),
            kv_indptr=torch.cat([zero, torch.cumsum(seq_lens, 0)]).int().to(dev),
            kv_slots=self.table.gather(req_slots, seq_lens),
            prefix_lens=prefix_lens.int().to(dev),
            extend_lens=extend_lens.int().to(dev),
            seq_lens=seq_lens.int().to(dev),
            max_seq_len=int(seq_lens.max()),
            max_extend_len=int(extend_lens.max()),
        )
        input_ids = host(np.concatenate([r.input_ids for r in reqs])).to(dev)
        positions = segment_arange(extend_lens, prefix_lens).to(dev)
        return input_ids, positions, meta


def _sampled_token(out: SampleOutput, j: int) -> engine_pb2.SampledToken:
    token = engine_pb2.SampledToken(token_id=out.token_ids[j])
    if out.logprobs[j] is not None:
        token.logprob.token_id = out.token_ids[j]
        token.logprob.logprob = out.logprobs[j]
        for tid, lp in out.top_logprobs[j] or []:
            token.logprob.top.append(engine_pb2.TopLogprob(token_id=tid, logprob=lp))
    return token
