"""CUDA graphs for decode: capture the whole forward once per batch size, then replay.

A graph replays fixed kernels on fixed addresses, so every input lives in a static buffer
that ``replay`` refills, and attention must read per-step sizes from device buffers (the
``triton`` backend does). A batch of n replays the smallest captured size >= n; padding
rows use KV slot 0 and the table's padding row, and their results are dropped.
"""

from __future__ import annotations

import logging

import torch

from services.worker.attention.base import AttentionMeta
from services.worker.models.llama import LlamaForCausalLM
from services.worker.req_table import ReqToTokenTable

log = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs]
    sizes += list(range(16, max_bs + 1, 8))
    if max_bs >= 1 and max_bs not in sizes:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    """Captured decode graphs of ``model`` (forward + compute_logits), one per batch size."""

    def __init__(
        self, model: LlamaForCausalLM, max_bs: int, table: ReqToTokenTable, device: torch.device
    ):
        if max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {max_bs}")
        self.model = model
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.table = table
        self._alloc_buffers(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # static output of each graph: [bs, vocab]
        self._capture_all(device)

    def _capture_all(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self._pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first: smaller ones reuse its memory
            self._capture(bs)
        torch.cuda.synchronize(device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _alloc_buffers(self, device: torch.device) -> None:
        n = self.max_bs

        def i32(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=torch.int32)

        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_slots = torch.zeros(n, dtype=torch.int64, device=device)
        self.qo_indptr = i32(torch.arange(n + 1))
        self.req_slots = i32(torch.full((n,), self.table.padding_row))
        self.prefix_lens = i32(torch.zeros(n))
        self.extend_lens = i32(torch.ones(n))
        self.seq_lens = i32(torch.ones(n))

    def _static_meta(self, bs: int) -> AttentionMeta:
        return AttentionMeta(
            is_decode=True,
            out_slots=self.out_slots[:bs],
            qo_indptr=self.qo_indptr[: bs + 1],
            req_to_token=self.table.table,
            req_slots=self.req_slots[:bs],
            prefix_lens=self.prefix_lens[:bs],
            extend_lens=self.extend_lens[:bs],
            seq_lens=self.seq_lens[:bs],
            max_seq_len=self.table.max_context,  # an upper bound; decode kernels ignore it
            max_extend_len=1,
        )

    def _run(self, bs: int, meta: AttentionMeta) -> torch.Tensor:
        hidden = self.model.forward(self.input_ids[:bs], self.positions[:bs], meta)
        return self.model.compute_logits(hidden)  # [bs, vocab]

    def _capture(self, bs: int) -> None:
        meta = self._static_meta(bs)
        # Warm up on a side stream so Triton and cuBLAS set up before, not during, capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._run(bs, meta)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.logits[bs] = self._run(bs, meta)
        self.graphs[bs] = graph

    def can_run(self, batch_size: int) -> bool:
        return 1 <= batch_size <= self.max_bs

    def _graph_size(self, batch_size: int) -> int:
        return next(bs for bs in self.sizes if bs >= batch_size)

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta
    ) -> torch.Tensor:
        """Logits [B, vocab] (float32) of a decode batch of B <= max_bs requests."""
        n, bs = meta.batch_size, self._graph_size(meta.batch_size)
        if meta.req_to_token is not self.table.table:
            raise ValueError("the graphs read the table they were captured with")
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:bs].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:bs].zero_()
        self.out_slots[:n].copy_(meta.out_slots)
        self.out_slots[n:bs].zero_()
        self.req_slots[:n].copy_(meta.req_slots)
        self.req_slots[n:bs].fill_(self.table.padding_row)
        self.prefix_lens[:n].copy_(meta.prefix_lens)
        self.prefix_lens[n:bs].zero_()
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        # A copy: the static output is overwritten by the next replay.
        return self._launch(bs)[:n].clone()

    def _launch(self, bs: int) -> torch.Tensor:
        """Logits [bs, vocab] of the graph of size bs (test doubles override this)."""
        self.graphs[bs].replay()
        return self.logits[bs]
