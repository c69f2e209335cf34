"""One rank's model, KV pool and request table, and the step loop of ranks 1..N-1.

Rank 0 stages each batch, sends it as a ForwardStep and runs it; every other rank receives,
writes the same table rows, runs the same forward on its shard and joins the logits
gather, until STOP. Sampling and grammars live on rank 0 alone.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.attention.base import AttentionBackend
from services.worker.attention.torch_backend import TorchBackend
from services.worker.kv_pool import KVPool, KVShape
from services.worker.model_loader import load_config, pack_for_cpu
from services.worker.models.llama import head_dim_of
from services.worker.parallel.group import TpGroup
from services.worker.parallel.shard_model import load_for_rank, local_heads
from services.worker.parallel.step_channel import ForwardStep, Op, StepChannel
from services.worker.req_table import ReqToTokenTable
from services.worker.step_inputs import host_arrays

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankShape:
    num_slots: int
    max_running_requests: int
    max_context: int

    def send(self, channel: StepChannel) -> None:
        ints = [self.num_slots, self.max_running_requests, self.max_context]
        channel.send(Op.SETUP, ints, [])

    @classmethod
    def recv(cls, channel: StepChannel) -> RankShape:
        message = channel.recv()
        if message.op != Op.SETUP:
            raise ValueError(f"tensor parallelism: expected the sizes first, got {message.op!r}")
        slots, rows, context = message.ints
        return cls(slots, rows, context)


class RankModel:
    """A rank's model shard with its pool, table and attention backend. ``shape`` None: the
    sizes come from rank 0 after this rank's weights load (so all ranks load at once)."""

    def __init__(
        self,
        model_path: str,
        tp: TpGroup,
        device: torch.device,
        shape: RankShape | None,
        backend: type[AttentionBackend] = TorchBackend,
        dtype: torch.dtype = torch.float32,
        cpu_linear: str = "packed",
    ):
        self.tp, self.device = tp, device
        self.channel = StepChannel(tp)
        self.config = c = load_config(model_path)
        self.model, self.bytes_read = load_for_rank(model_path, c, dtype, device, tp)
        pack_for_cpu(self.model, cpu_linear, device)
        shape = shape if shape is not None else RankShape.recv(self.channel)
        heads, kv_heads = local_heads(c, tp)
        d = head_dim_of(c)
        kv_shape = KVShape(c.num_hidden_layers, kv_heads, d, dtype)
        self.kv_pool = KVPool(kv_shape, shape.num_slots, device)
        self.model.attach(backend(heads, kv_heads, d, d**-0.5), self.kv_pool)
        self.table = ReqToTokenTable(shape.max_running_requests, shape.max_context, device)
        self.hidden = torch.empty(0, c.hidden_size, device=device)

    def forward_step(self, step: ForwardStep) -> torch.Tensor:
        """Logits [n, vocab] of ``step.logit_rows`` on rank 0, empty elsewhere."""
        for row, slots in step.prefixes():
            self.table.write_prefix(row, torch.from_numpy(slots))
        s = step.inputs(self.device)
        self.table.write_tokens(s.token_rows, s.positions, s.out_slots)
        meta = s.attention_meta(step.is_decode, self.table.table)
        # Kept for the step's LOGITS messages (prompt logprobs).
        self.hidden = self.model.forward(s.input_ids, s.positions, meta)
        return self.rows_logits(step.logit_rows)

    def rows_logits(self, rows: np.ndarray) -> torch.Tensor:
        """Logits of rows of the last forward (rank 0; empty elsewhere); no rows, no gather."""
        if len(rows) == 0:
            return torch.empty(0, self.config.vocab_size, device=self.hidden.device)
        index = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)).to(self.hidden.device)
        return self.model.compute_logits(self.hidden[index])

    def lead(self, step: ForwardStep) -> torch.Tensor:
        step.send(self.channel)
        return self.forward_step(step)

    def lead_logits(self, rows: np.ndarray) -> torch.Tensor:
        """Rank 0: more rows of the last forward through the lm_head, all ranks gathering."""
        self.channel.send(Op.LOGITS, [], [np.ascontiguousarray(rows, dtype=np.int64)])
        return self.rows_logits(rows)

    def follow(self) -> int:
        """Ranks 1..N-1: runs rank 0's steps until STOP; returns how many."""
        steps = 0
        while True:
            message = self.channel.recv()
            if message.op == Op.STOP:
                return steps
            if message.op == Op.PING:
                continue
            if message.op == Op.LOGITS:
                self.rows_logits(message.arrays[0].numpy())
                continue
            if message.op != Op.FORWARD:
                raise ValueError(f"tensor parallelism: rank {self.tp.rank} got {message.op!r}")
            self.forward_step(ForwardStep.of(message))
            steps += 1

    def stop(self) -> None:
        self.channel.send(Op.STOP, [], [])


def make_step(
    ids: Sequence[np.ndarray],
    out_slots: Sequence[np.ndarray],
    req_slots: Sequence[int],
    prefix_lens: Sequence[int],
    is_decode: bool,
    logit_rows: np.ndarray,
    prefixes: Sequence[tuple[int, np.ndarray]] = (),
) -> ForwardStep:
    rows = np.asarray(req_slots, dtype=np.int64)
    arrays, t, b = host_arrays(ids, out_slots, rows, np.asarray(prefix_lens, dtype=np.int64))
    none = np.zeros(0, dtype=np.int64)
    return ForwardStep(
        flat=np.concatenate(arrays),
        t=t,
        b=b,
        max_seq_len=int(arrays[7].max()) if b else 0,
        max_extend_len=int(arrays[6].max()) if b else 0,
        is_decode=is_decode,
        prefix_rows=np.array([r for r, _ in prefixes], dtype=np.int64),
        prefix_lens=np.array([len(s) for _, s in prefixes], dtype=np.int64),
        prefix_slots=np.concatenate([s for _, s in prefixes]).astype(np.int64)
        if prefixes
        else none,
        logit_rows=np.asarray(logit_rows, dtype=np.int64),
    )
