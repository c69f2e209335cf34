"""Next-token sampling with per-request state kept by request slot.

Per row: allowed mask -> min_tokens mask -> penalties -> logit_bias -> (greedy: argmax)
-> temperature -> top-k -> top-p -> min-p -> draw. Penalties count generated tokens only:
the worker never sees the cached part of a prompt, so counting it would make the output
depend on the radix cache. logit_bias comes after the masks, so it cannot revive a token a
grammar or min_tokens forbids. Logprobs are raw (log_softmax before any processing). Draws
are keyed by (seed, tokens generated so far), so a recomputed or speculative row draws the
same token (verify-step rules: docs/speculative.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
# Below this, logits / temperature overflow float32 and softmax gives NaN; vLLM uses 1e-5 too.
GREEDY_BELOW = 1e-5


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
    min_tokens: int = 0
    min_tokens_ban: tuple[int, ...] = ()  # token ids masked until min_tokens are generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1

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


def _signed(c: int) -> int:
    """A 64-bit constant as torch's int64 holds it (two's complement)."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = (
    _signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
)


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] float64 Exp(1) draws from splitmix64 of (row key, token id): same bits on
    every device."""
    token = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)
    z = keys[:, None] + token[None, :] * _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    uniform = (_shr(z, 11).double() + 1.0) * 2.0**-53  # never 0: no 0/0 for a dead token
    return -torch.log(uniform)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # None where not asked for
    top_logprobs: list[list[tuple[int, float]] | None]  # best first
    # With drafts: per slot, the tokens committed after token_ids[j] and their logprobs.
    extra_token_ids: list[list[int]] = field(default_factory=list)  # empty: no drafts
    extra_logprobs: list[list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=list)


@dataclass(frozen=True)
class _Rows:
    """The rows of one sampling call: one per slot, or 1 + len(drafts) for a slot with drafts."""

    slots: list[int]  # [R] the slot of each row
    specs: list[SamplingSpec]  # [R]
    generated: list[int]  # [R] tokens the slot has generated before this row's token
    # (row, token) pairs penalties count beyond the slot's counts (row i: drafts[:i]).
    draft_pairs: list[tuple[int, int]]


# Columns of Sampler.params, one row per request slot (written once, at reset_slot).
TEMP, TOP_K, TOP_P, MIN_P, REP, FREQ, PRES, GREEDY, PENALTY = range(9)


def _param_row(spec: SamplingSpec, vocab_size: int) -> list[float]:
    """A slot's row of Sampler.params: neutral values where a feature is off, so one
    batched expression serves every row exactly."""
    return [
        1.0 if spec.greedy else spec.temperature,  # greedy rows are argmax'd, never divided
        float(spec.top_k if spec.top_k > 0 else vocab_size),
        spec.top_p,
        spec.min_p,
        spec.repetition_penalty,
        spec.frequency_penalty,
        spec.presence_penalty,
        float(spec.greedy),
        float(spec.has_penalty),
    ]


class Sampler:
    """Per-request-slot sampling state and the batched sampling step. Per-slot parameters
    live on the device, so a step sends one small host-to-device copy (slot ids, keys)."""

    def __init__(
        self, max_running_requests: int, vocab_size: int, device: torch.device, random_seed: int
    ):
        self.vocab_size = vocab_size
        self.device = device
        self.specs: list[SamplingSpec | None] = [None] * max_running_requests
        self.num_generated = [0] * max_running_requests
        self.params = torch.zeros((max_running_requests, 9), dtype=torch.float32, device=device)
        self.counts = torch.zeros(
            (max_running_requests, vocab_size), dtype=torch.int32, device=device
        )
        self.rng = np.random.default_rng(random_seed)
        # Slots below min_tokens / with a logit_bias; a stale entry lingers until the slot
        # is reused, which costs a membership test, never a wrong mask.
        self.below_min: set[int] = set()
        self.biases: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def reset_slot(self, slot: int, spec: SamplingSpec, output_ids: np.ndarray) -> None:
        """A request (new, or back after a retraction) takes ``slot``."""
        self.specs[slot] = spec
        self.num_generated[slot] = int(len(output_ids))
        self.below_min.discard(slot)
        if spec.min_tokens_ban and self.num_generated[slot] < spec.min_tokens:
            self.below_min.add(slot)
        self.biases.pop(slot, None)
        if spec.logit_bias:
            self.biases[slot] = (
                np.array([t for t, _ in spec.logit_bias], np.int64),
                np.array([b for _, b in spec.logit_bias], np.float32),
            )
        self.params[slot] = torch.tensor(_param_row(spec, self.vocab_size))
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

    def sample(
        self,
        logits: torch.Tensor,
        slots: list[int],
        allowed: torch.Tensor | None = None,
        drafts: list[np.ndarray] | None = None,
    ) -> SampleOutput:
        """logits [R, V] float32; allowed [R, V] bool or None (all). Without ``drafts`` one
        row per slot; with them slot j has 1 + len(drafts[j]) consecutive rows, and its
        accepted drafts plus next token come back as token_ids[j], then extra_token_ids[j]."""
        rows = self._rows(slots, drafts)
        token_ids, raw, idx, params = self._choose(logits, rows, allowed)
        if drafts is None or len(rows.slots) == len(slots):
            self._record(slots, rows.specs, idx, params, token_ids)
            out = self._output(token_ids, rows.specs, raw)
            if drafts is not None:
                out.extra_token_ids = [[] for _ in slots]
                out.extra_logprobs = [[] for _ in slots]
            return out
        return self._verified(slots, drafts, rows, token_ids, raw)

    def _rows(self, slots: list[int], drafts: list[np.ndarray] | None) -> _Rows:
        specs = [self.spec(s) for s in slots]
        generated = [self.num_generated[s] for s in slots]
        if drafts is None or not any(len(d) for d in drafts):
            return _Rows(slots, specs, generated, [])
        r_slots: list[int] = []
        r_specs: list[SamplingSpec] = []
        r_gen: list[int] = []
        pairs: list[tuple[int, int]] = []
        for s, sp, gen, d in zip(slots, specs, generated, drafts, strict=True):
            toks = d.tolist()
            for i in range(len(toks) + 1):
                row = len(r_slots)
                r_slots.append(s)
                r_specs.append(sp)
                r_gen.append(gen + i)
                if sp.has_penalty:
                    pairs.extend((row, t) for t in toks[:i])
        return _Rows(r_slots, r_specs, r_gen, pairs)

    def _choose(
        self, logits: torch.Tensor, rows: _Rows, allowed: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(token [R], raw logprobs [R, V] or None, slot ids [R], params [R, 9])."""
        specs = rows.specs
        idx, keys = self._step_indices(rows)
        params = self.params[idx]  # [R, 9]
        raw_logprobs = None
        if any(sp.logprobs for sp in specs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))  # a copy: input untouched
        if self.below_min and not self.below_min.isdisjoint(rows.slots):
            logits = self._min_tokens_masked(logits, rows)
        if any(sp.has_penalty for sp in specs):
            logits = self._penalized(logits, self._row_counts(idx, rows), params)
        if self.biases and not self.biases.keys().isdisjoint(rows.slots):
            logits = self._biased(logits, rows.slots)
        token_ids = torch.argmax(logits, dim=-1)  # the greedy choice of every row
        if not all(sp.greedy for sp in specs):
            probs = self._processed_probs(logits, params, specs)
            drawn = torch.argmax(probs / exponential_noise(keys, probs.shape[1]).float(), dim=-1)
            token_ids = torch.where(params[:, GREEDY] > 0, token_ids, drawn)
        return token_ids, raw_logprobs, idx, params

    def _row_counts(self, idx: torch.Tensor, rows: _Rows) -> torch.Tensor:
        """[R, V] float32 generated-token counts per row, drafts the row assumes included."""
        counts = self.counts[idx].float()
        if rows.draft_pairs:
            rc = torch.tensor(rows.draft_pairs, dtype=torch.int64).T.to(self.device)
            counts.index_put_((rc[0], rc[1]), torch.ones_like(rc[0], dtype=counts.dtype), True)
        return counts

    def _step_indices(self, rows: _Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot ids [R], draw keys [R]) on the device, in one copy."""
        slots = rows.slots
        host = np.empty((2, len(slots)), dtype=np.int64)
        host[0] = slots
        host[1] = self.rng.integers(0, 2**62, size=len(slots))
        for j, sp in enumerate(rows.specs):
            if sp.seed is not None:
                host[1, j] = step_seed(sp.seed, rows.generated[j])
        both = torch.from_numpy(host).to(self.device, non_blocking=True)
        return both[0], both[1]

    def _verified(
        self,
        slots: list[int],
        drafts: list[np.ndarray],
        rows: _Rows,
        token_ids: torch.Tensor,
        raw: torch.Tensor | None,
    ) -> SampleOutput:
        """Per slot: the confirmed drafts plus the first differing choice, recorded."""
        chosen = token_ids.tolist()
        committed: list[list[int]] = []
        first_rows: list[int] = []
        row = 0
        for d in drafts:
            toks = d.tolist()
            m = 0
            while m < len(toks) and chosen[row + m] == toks[m]:
                m += 1
            committed.append(chosen[row : row + m + 1])
            first_rows.append(row)
            row += len(toks) + 1
        for s, toks in zip(slots, committed, strict=True):
            self._record_tokens(s, toks)
        lps = self._committed_logprobs(raw, rows.specs, first_rows, committed)
        specs = [rows.specs[r] for r in first_rows]
        out = SampleOutput(
            [t[0] for t in committed],
            [lp[0][0] if lp else None for lp in lps],
            [lp[0][1] if lp and specs[j].top_logprobs > 0 else None for j, lp in enumerate(lps)],
        )
        out.extra_token_ids = [t[1:] for t in committed]
        out.extra_logprobs = [lp[1:] for lp in lps]
        return out

    def _committed_logprobs(
        self,
        raw: torch.Tensor | None,
        specs: list[SamplingSpec],
        first_rows: list[int],
        committed: list[list[int]],
    ) -> list[list[tuple[float, list[tuple[int, float]]]]]:
        """Per slot: (raw logprob, top) of each committed token; [] if logprobs not asked."""
        out: list[list[tuple[float, list[tuple[int, float]]]]] = [[] for _ in committed]
        if raw is None:
            return out
        want = [j for j, r in enumerate(first_rows) if specs[r].logprobs]
        row_ids = [first_rows[j] + i for j in want for i in range(len(committed[j]))]
        toks = [t for j in want for t in committed[j]]
        index = torch.tensor(row_ids, dtype=torch.int64, device=raw.device)
        picked = raw[index]  # [n, V]
        values = picked.gather(1, torch.tensor(toks, device=raw.device)[:, None])[:, 0].tolist()
        n_top = max(specs[first_rows[j]].top_logprobs for j in want)
        best = picked.topk(n_top, dim=-1) if n_top > 0 else None
        at = 0
        for j in want:
            k = specs[first_rows[j]].top_logprobs
            for _ in committed[j]:
                top: list[tuple[int, float]] = []
                if best is not None and k > 0:
                    ids_k = best.indices[at, :k].tolist()
                    top = list(zip(ids_k, best.values[at, :k].tolist(), strict=True))
                out[j].append((values[at], top))
                at += 1
        return out

    def _min_tokens_masked(self, logits: torch.Tensor, plan: _Rows) -> torch.Tensor:
        """A copy of ``logits`` with under-floor rows' banned ids at -inf, unless that leaves
        a row nothing (a finished grammar allows only EOS): then the grammar's end wins."""
        pairs = [
            (j, t)
            for j, (gen, sp) in enumerate(zip(plan.generated, plan.specs, strict=True))
            if gen < sp.min_tokens
            for t in sp.min_tokens_ban
        ]
        if not pairs:
            return logits
        rc = torch.tensor(pairs, dtype=torch.int64).T.to(self.device, non_blocking=True)
        rows, cols = rc[0], rc[1]
        saved = logits[rows, cols]  # [K]
        masked = logits.index_put((rows, cols), torch.full_like(saved, float("-inf")))  # [N, V]
        dead = torch.isneginf(masked.amax(dim=-1))  # [N]
        return masked.index_put_((rows, cols), torch.where(dead[rows], saved, float("-inf")))

    def _biased(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """A copy of ``logits`` with each biased row's biases added (one scatter-add)."""
        rows, cols, values = [], [], []
        for j, s in enumerate(slots):
            if s in self.biases:
                ids, vals = self.biases[s]
                rows.append(np.full(len(ids), j, np.int64))
                cols.append(ids)
                values.append(vals)
        rc = torch.from_numpy(np.stack([np.concatenate(rows), np.concatenate(cols)]))
        rc = rc.to(self.device, non_blocking=True)  # [2, K]
        add = torch.from_numpy(np.concatenate(values)).to(self.device, non_blocking=True)
        return logits.index_put((rc[0], rc[1]), add, accumulate=True)  # [N, V]

    def apply_penalties(self, logits: torch.Tensor, slots: list[int]) -> torch.Tensor:
        """Repetition / frequency / presence penalties from each slot's generated tokens."""
        idx = torch.tensor(slots, dtype=torch.int64, device=self.device)
        return self._penalized(logits, self.counts[idx].float(), self.params[idx])

    def _penalized(
        self, logits: torch.Tensor, counts: torch.Tensor, params: torch.Tensor
    ) -> torch.Tensor:
        """HF-style repetition, then frequency and presence, over counts [N, V]."""
        rep, freq, pres = params[:, REP, None], params[:, FREQ, None], params[:, PRES, None]
        seen = counts > 0
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        out = torch.where(seen, penalised, logits)
        return out - freq * counts - pres * seen.float()

    def _processed_probs(
        self, logits: torch.Tensor, params: torch.Tensor, specs: list[SamplingSpec]
    ) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p over [N, V] logits -> [N, V] probabilities."""
        logits = logits / params[:, TEMP, None]
        if all(sp.top_k <= 0 and sp.top_p >= 1.0 and sp.min_p <= 0.0 for sp in specs):
            return torch.softmax(logits, dim=-1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V]
        rank = torch.arange(logits.shape[1], device=logits.device)[None, :]
        remove = rank >= params[:, TOP_K, None]
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        top_p = params[:, TOP_P, None]
        # top_p 1: float rounding must not cut the tail.
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove |= (mass_before >= top_p) & (top_p < 1.0)
        remove |= probs < params[:, MIN_P, None] * probs[:, :1]
        remove[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        out = torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
        return torch.softmax(out, dim=-1)

    def _record(
        self,
        slots: list[int],
        specs: list[SamplingSpec],
        idx: torch.Tensor,
        params: torch.Tensor,
        token_ids: torch.Tensor,
    ) -> None:
        for s in slots:
            self.num_generated[s] += 1
        if self.below_min:
            self.below_min.difference_update(
                [s for s in slots if self.num_generated[s] >= self.spec(s).min_tokens]
            )
        if any(sp.has_penalty for sp in specs):  # adds 0 for the rows without penalties
            self.counts.index_put_(
                (idx, token_ids), params[:, PENALTY].to(torch.int32), accumulate=True
            )

    def _record_tokens(self, slot: int, tokens: list[int]) -> None:
        self.num_generated[slot] += len(tokens)
        spec = self.spec(slot)
        if slot in self.below_min and self.num_generated[slot] >= spec.min_tokens:
            self.below_min.discard(slot)
        if spec.has_penalty:
            ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            self.counts[slot].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

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
