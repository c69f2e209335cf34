"""Next-token sampling with per-request state kept by request slot.

Order applied to each row's float32 logits:

    allowed-token mask -> penalties -> (greedy: argmax)
                          -> temperature -> top-k -> top-p -> min-p -> draw

Choices (documented because clients see them):
- Penalties (repetition, frequency, presence) count the request's *generated* tokens only.
  The worker never sees the cached part of a prompt (it gets KV slots, not token ids), so
  counting the prompt would make the output depend on what the radix cache held.
  Repetition divides positive logits / multiplies negative ones by the penalty (as HF);
  frequency subtracts penalty * count; presence subtracts penalty once a token appeared.
- Logprobs are "raw": log_softmax of the model's logits before any processing, for the
  chosen token and the top-n alternatives (best first).
- A seeded request draws with a generator seeded from (seed, tokens generated so far), so
  a request retracted and recomputed draws the very same tokens. Unseeded requests share
  the worker's generator (seeded by --random-seed).
- Stopping (EOS, stop ids, ignore_eos, max_tokens) is the scheduler's job.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingSpec:
    """SamplingParams with the defaults applied."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def has_penalty(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )


def step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed from (request seed, tokens generated so far) (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # None where not asked for
    top_logprobs: list[list[tuple[int, float]] | None]  # best first


class Sampler:
    """Per-request-slot sampling state and the batched sampling step."""

    def __init__(
        self, max_running_requests: int, vocab_size: int, device: torch.device, random_seed: int
    ):
        self.vocab_size = vocab_size
        self.device = device
        self.specs: list[SamplingSpec | None] = [None] * max_running_requests
        self.num_generated = [0] * max_running_requests
        # Token counts of generated tokens, only read for slots with penalties.
        self.counts = torch.zeros(
            (max_running_requests, vocab_size), dtype=torch.int32, device=device
        )
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(random_seed)

    def reset_slot(self, slot: int, spec: SamplingSpec, output_ids: np.ndarray) -> None:
        """A request (new, or back after a retraction) takes ``slot``."""
        self.specs[slot] = spec
        self.num_generated[slot] = int(len(output_ids))
        self.counts[slot].zero_()
        if len(output_ids):
            ids = torch.as_tensor(np.asarray(output_ids, dtype=np.int64), device=self.device)
            self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def has_state(self, slot: int) -> bool:
        return self.specs[slot] is not None

    def spec(self, slot: int) -> SamplingSpec:
        """The slot's sampling spec; the runner refuses a batch naming a slot never started."""
        spec = self.specs[slot]
        assert spec is not None, f"req_slot {slot} has no sampling state"
        return spec

    # ---- the step --------------------------------------------------------------------

    def sample(
        self, logits: torch.Tensor, slots: list[int], allowed: torch.Tensor | None = None
    ) -> SampleOutput:
        """logits [N, V] float32, one row per slot; allowed [N, V] bool or None (all).

        ``allowed`` is the hook for constrained decoding: the worker's own grammar state
        (not a wire field) will say which tokens each row may take."""
        specs = [self.spec(s) for s in slots]
        raw_logprobs = None
        if any(sp.logprobs for sp in specs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))  # a copy: input untouched
        logits = self.apply_penalties(logits, slots)
        token_ids = self._choose(logits, specs, [self.num_generated[s] for s in slots])
        self._record(slots, token_ids)
        return self._output(token_ids, specs, raw_logprobs)

    def apply_penalties(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Repetition / frequency / presence penalties from each slot's generated tokens."""
        specs = [self.spec(s) for s in slots]
        rows = [i for i, sp in enumerate(specs) if sp.has_penalty]
        if not rows:
            return logits
        dev = logits.device
        counts = self.counts[[slots[i] for i in rows]].float()  # [n, V]
        rep = torch.tensor([specs[i].repetition_penalty for i in rows], device=dev)[:, None]
        freq = torch.tensor([specs[i].frequency_penalty for i in rows], device=dev)[:, None]
        pres = torch.tensor([specs[i].presence_penalty for i in rows], device=dev)[:, None]
        sub = logits[rows]
        seen = counts > 0
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub = sub - freq * counts - pres * seen.float()
        logits = logits.clone()
        logits[rows] = sub
        return logits

    def _choose(
        self, logits: torch.Tensor, specs: list[SamplingSpec], steps: list[int]
    ) -> torch.Tensor:
        token_ids = torch.argmax(logits, dim=-1)  # greedy rows
        rows = [i for i, sp in enumerate(specs) if not sp.greedy]
        if rows:
            probs = self._processed_probs(logits[rows], [specs[i] for i in rows])
            token_ids[rows] = self._draw(probs, [specs[i] for i in rows], [steps[i] for i in rows])
        return token_ids

    def _processed_probs(self, logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p over [n, V] logits -> [n, V] probabilities."""
        dev = logits.device
        temp = torch.tensor([sp.temperature for sp in specs], device=dev)[:, None]
        logits = logits / temp
        if all(sp.top_k <= 0 and sp.top_p >= 1.0 and sp.min_p <= 0.0 for sp in specs):
            return torch.softmax(logits, dim=-1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, V]
        rank = torch.arange(logits.shape[1], device=dev)[None, :]
        top_k = torch.tensor(
            [sp.top_k if sp.top_k > 0 else logits.shape[1] for sp in specs], device=dev
        )
        remove = rank >= top_k[:, None]
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        top_p = torch.tensor([sp.top_p for sp in specs], device=dev)[:, None]
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove |= (mass_before >= top_p) & (
            top_p < 1.0
        )  # top_p 1: float rounding must not cut the tail
        min_p = torch.tensor([sp.min_p for sp in specs], device=dev)[:, None]
        remove |= probs < min_p * probs[:, :1]
        remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        out = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
        return torch.softmax(out, dim=-1)

    def _draw(
        self, probs: torch.Tensor, specs: list[SamplingSpec], steps: list[int]
    ) -> torch.Tensor:
        """One token per row: argmax(probs / Exp(1) noise), the noise from the row's generator."""
        noise = torch.empty_like(probs)
        for j, sp in enumerate(specs):
            if sp.seed is None:
                noise[j].exponential_(generator=self.generator)
            else:
                gen = torch.Generator(device=probs.device)
                gen.manual_seed(step_seed(sp.seed, steps[j]))
                noise[j].exponential_(generator=gen)
        # A zero draw would make 0/0 = NaN for a zero-probability token.
        return torch.argmax(probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny), dim=-1)

    def _record(self, slots: list[int], token_ids: torch.Tensor) -> None:
        for s in slots:
            self.num_generated[s] += 1
        pen = [i for i, s in enumerate(slots) if self.spec(s).has_penalty]
        if pen:
            idx = torch.tensor([slots[i] for i in pen], device=self.counts.device)
            self.counts.index_put_(
                (idx, token_ids[pen]),
                torch.ones(len(pen), dtype=torch.int32, device=self.counts.device),
                accumulate=True,
            )

    def _output(
        self, token_ids: torch.Tensor, specs: list[SamplingSpec], raw: torch.Tensor | None
    ) -> SampleOutput:
        ids = token_ids.tolist()
        logprobs: list[float | None] = [None] * len(ids)
        tops: list[list[tuple[int, float]] | None] = [None] * len(ids)
        if raw is None:
            return SampleOutput(ids, logprobs, tops)
        chosen = raw.gather(1, token_ids[:, None])[:, 0].tolist()
        n_top = max(sp.top_logprobs for sp in specs)
        best = raw.topk(n_top, dim=-1) if n_top > 0 else None  # values, indices: [N, n_top]
        for i, sp in enumerate(specs):
            if not sp.logprobs:
                continue
            logprobs[i] = chosen[i]
            if best is not None and sp.top_logprobs > 0:
                k = sp.top_logprobs
                ids_k, vals_k = best.indices[i, :k].tolist(), best.values[i, :k].tolist()
                tops[i] = list(zip(ids_k, vals_k, strict=True))
        return SampleOutput(ids, logprobs, tops)
