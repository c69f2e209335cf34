"""The plain data the model runner takes and returns: no protobuf past wire.py, so a test
can drive the runner directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.worker.sampling import SamplingSpec


@dataclass(frozen=True)
class Constraint:
    """A grammar the request's tokens must follow; the compiled-grammar cache key."""

    kind: str  # "json_schema" | "regex" | "ebnf" | "json_object" | "structural_tag"
    text: str  # the schema, regex, grammar or structural tag ("" for json_object)


@dataclass(frozen=True)
class GrammarStatus:
    rid: str
    error: str = ""
    error_code: str = ""  # gRPC status name: INVALID_ARGUMENT, DEADLINE_EXCEEDED


@dataclass(frozen=True)
class SlotStart:
    prefix_slots: np.ndarray  # [prefix_len] int32: KV slots of positions [0, prefix_len)
    sampling: SamplingSpec
    output_ids: np.ndarray  # int32: tokens generated so far (penalties, seeded draws)
    keep_last_sampled: bool  # overlap schedule: its input is the slot's last sampled token
    constraint: Constraint | None = None  # constrained decoding (grammar/), None: free


@dataclass(frozen=True)
class PromptScore:
    row: int  # first new token of the request whose logits score targets[0]
    targets: np.ndarray  # [k] int32: the prompt token each scored row (row .. row+k-1) predicts
    top: int  # alternatives per entry (0: none)


# One scored prompt token: (token id, logprob, [(alternative, logprob)] best first).
Scored = tuple[int, float, list[tuple[int, float]]]


@dataclass(frozen=True)
class ReqInput:
    """One request's part of a batch; new tokens at positions prefix_len onwards."""

    req_slot: int  # row of the request-slot table
    input_ids: np.ndarray  # [n] int32; empty when use_last_sampled
    out_slots: np.ndarray  # [n] int32: KV slot of each new token
    prefix_len: int  # tokens of this request already in the pool
    sample: bool  # false for a prefill chunk that is not the last
    use_last_sampled: bool  # the one input token is the slot's last sampled token
    start: SlotStart | None = None  # set the first time the request uses req_slot
    rid: str = ""
    score: PromptScore | None = None
    # [k] int32 speculative drafts after input_ids (out_slots covers both); None: plain step.
    drafts: np.ndarray | None = None

    @property
    def n_new(self) -> int:
        return len(self.out_slots)

    @property
    def where(self) -> str:
        return f"request {self.rid or '?'} (req_slot {self.req_slot})"


@dataclass(frozen=True)
class Batch:
    """One forward step: every request's new tokens, concatenated in request order."""

    is_decode: bool  # every request has exactly one new token (and no drafts)
    reqs: list[ReqInput] = field(default_factory=list)

    @property
    def has_drafts(self) -> bool:
        return any(r.drafts is not None for r in self.reqs)


@dataclass
class ForwardOutput:
    """One entry per request of the batch, in order."""

    token_ids: list[int]  # -1 where the request was not sampled
    logprobs: list[float | None]  # raw logprob of the chosen token; None where not asked
    top_logprobs: list[list[tuple[int, float]] | None]  # (token, logprob), best first
    grammar_terminated: list[bool] = field(default_factory=list)  # empty: none constrained
    grammar_errors: list[str] = field(default_factory=list)  # "" per row, or empty
    grammar_dead_ends: list[bool] = field(default_factory=list)  # the error is the grammar's
    prompt_logprobs: list[list[Scored] | None] = field(default_factory=list)
    # Verify steps: per request, tokens committed after token_ids[i]; empty: no drafts.
    extra_token_ids: list[list[int]] = field(default_factory=list)
    extra_logprobs: list[list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=list)
    cuda_graph: bool = False  # decode replayed a captured CUDA graph
    forward_time: float = 0.0  # seconds in the model forward + sampling


@dataclass(frozen=True)
class RunnerInfo:
    """Field names as WorkerInfo's, which wire.py fills from it."""

    model_id: str
    architecture: str
    vocab_size: int
    max_model_len: int  # context length: prefix_len + new tokens never exceed it
    max_total_num_tokens: int  # KV slots in the pool (slot 0, padding, excluded)
    max_running_requests: int  # rows of the request-slot table
    device: str
    dtype: str
    attention_backend: str
    num_parameters: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    eos_token_ids: list[int]
    host_total_num_tokens: int = 0  # slots of the host tier (hierarchical cache; 0: none)
    storage_page_tokens: int = 0  # tokens per page of the storage tier (0: none)
    weights_fingerprint: str = ""  # model_loader.weights_fingerprint of the checkpoint
