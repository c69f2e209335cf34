"""Rank 0's step, sent to the other ranks as int64 tensors (never pickles). One message is
two broadcasts on the gloo group:

    header  [HEADER_WORDS] int64:  op, n_ints, n_arrays, ints[n_ints], lens[n_arrays]
    payload [sum(lens)]    int64:  the arrays end to end (not sent when empty)
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.worker.parallel.group import TpGroup
from services.worker.step_inputs import StepInputs

HEADER_WORDS = 32


class Op(enum.IntEnum):
    FORWARD = 1  # a ForwardStep: write table rows, run the model, then the logits rows
    LOGITS = 2  # rows of the last forward's hidden states through the lm_head (logprobs)
    STOP = 3  # rank 0 is leaving: the others leave too
    SETUP = 4  # the sizes rank 0 chose (KV slots, table rows, context), before any step
    PING = 5  # rank 0 is alive but idle: the others' wait for the next step starts over


@dataclass(frozen=True)
class Message:
    op: Op
    ints: list[int]
    arrays: list[torch.Tensor]  # int64, CPU


class StepChannel:
    """send on rank 0, recv on the others; every rank calls one per message, in order."""

    def __init__(self, tp: TpGroup):
        self.tp = tp

    def send(self, op: Op, ints: Sequence[int], arrays: Sequence[np.ndarray]) -> None:
        lens = [len(a) for a in arrays]
        words = [int(op), len(ints), len(arrays), *ints, *lens]
        if len(words) > HEADER_WORDS:
            raise ValueError(f"a step message of {len(words)} header words (max {HEADER_WORDS})")
        header = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        header[: len(words)] = torch.tensor(words, dtype=torch.int64)
        self.tp.broadcast_cpu(header)
        if sum(lens):
            flat = np.concatenate([np.asarray(a, dtype=np.int64) for a in arrays])
            self.tp.broadcast_cpu(torch.from_numpy(flat))

    def recv(self) -> Message:
        header = self.tp.broadcast_cpu(torch.zeros(HEADER_WORDS, dtype=torch.int64)).tolist()
        op, n_ints, n_arrays = header[:3]
        ints = header[3 : 3 + n_ints]
        lens = header[3 + n_ints : 3 + n_ints + n_arrays]
        payload = torch.empty(sum(lens), dtype=torch.int64)
        if sum(lens):
            self.tp.broadcast_cpu(payload)
        return Message(Op(op), ints, list(payload.split(lens)) if lens else [])


class LeadChannel(StepChannel):
    """Rank 0's end: an idle engine pings the others before their wait times out."""

    def __init__(self, tp: TpGroup):
        super().__init__(tp)
        self.last_sent = time.monotonic()

    def send(self, op: Op, ints: Sequence[int], arrays: Sequence[np.ndarray]) -> None:
        super().send(op, ints, arrays)
        self.last_sent = time.monotonic()

    def ping_if_idle(self, after_s: float) -> None:
        if time.monotonic() - self.last_sent >= after_s:
            self.send(Op.PING, [], [])


@dataclass(frozen=True)
class ForwardStep:
    """A forward's staged inputs, cached prefixes to write first, and logit rows."""

    flat: np.ndarray  # int64: step_inputs' staging layout, 4 T + 5 B + 1 words
    t: int
    b: int
    max_seq_len: int
    max_extend_len: int
    is_decode: bool
    prefix_rows: np.ndarray  # [P] req slots starting on a cached prefix
    prefix_lens: np.ndarray  # [P]
    prefix_slots: np.ndarray  # [sum(prefix_lens)] their KV slots, end to end
    logit_rows: np.ndarray  # [n] rows of the hidden states to take logits of

    def send(self, channel: StepChannel) -> None:
        ints = [self.t, self.b, self.max_seq_len, self.max_extend_len, int(self.is_decode)]
        arrays = [self.flat, self.prefix_rows, self.prefix_lens, self.prefix_slots]
        channel.send(Op.FORWARD, ints, [*arrays, self.logit_rows])

    @classmethod
    def of(cls, message: Message) -> ForwardStep:
        t, b, max_seq, max_ext, is_decode = message.ints
        flat, rows, lens, slots, logit_rows = (a.numpy() for a in message.arrays)
        return cls(flat, t, b, max_seq, max_ext, bool(is_decode), rows, lens, slots, logit_rows)

    def prefixes(self) -> list[tuple[int, np.ndarray]]:
        ends = np.cumsum(self.prefix_lens)
        starts = ends - self.prefix_lens
        return [
            (int(r), self.prefix_slots[s:e])
            for r, s, e in zip(self.prefix_rows, starts, ends, strict=True)
        ]

    def inputs(self, device: torch.device) -> StepInputs:
        flat = torch.from_numpy(self.flat).to(device)
        return StepInputs.of_flat(flat, self.t, self.b, self.max_seq_len, self.max_extend_len)
