"""Request validation: every field checked against the limits generation.proto documents.

Errors name the field by its path in GenerateRequest (``sampling.top_p``) and state the
limit, so the gRPC layer answers INVALID_ARGUMENT and the HTTP layer can map the field to
the OpenAI parameter.
"""

from __future__ import annotations

import json

from radixserve.v1 import generation_pb2 as pb
from services.common.sampling_limits import (
    prompt_logprobs_start_problem,
    sampling_bound_problem,
)

MAX_STOP_STRINGS = 16
# A token is rarely more than a few characters; one of more than this many would be
# pathological. A prompt longer than max_model_len * this cannot fit the context, so it is
# refused by its size before tokenizing (which costs seconds for megabytes of text).
MAX_CHARS_PER_TOKEN = 64
MAX_STOP_STRING_CHARS = 1024  # stop strings are matched against every streamed chunk
MAX_CACHE_SALT_CHARS = 1024  # salts are kept in the radix tree, one per cached branch
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_LEN = 256
# A constraint's text at most (characters): past it a schema or grammar is refused before
# the engine spends a compile on it.
MAX_CONSTRAINT_CHARS = 128 * 1024
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class ValidationError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _check_token_ids(field: str, ids, vocab_size: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValidationError(
                f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {vocab_size})"
            )


def validate_sampling(sp: pb.SamplingParams, vocab_size: int) -> None:
    bound = sampling_bound_problem(sp)
    if bound is not None:
        raise ValidationError(*bound)
    if len(sp.stop) > MAX_STOP_STRINGS:
        raise ValidationError(
            "sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(sp.stop)}"
        )
    for i, s in enumerate(sp.stop):
        if not s:
            raise ValidationError(f"sampling.stop[{i}]", "stop strings must be non-empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValidationError(
                f"sampling.stop[{i}]", f"at most {MAX_STOP_STRING_CHARS} characters, got {len(s)}"
            )
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise ValidationError(
            "sampling.stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(sp.stop_token_ids)}",
        )
    _check_token_ids("sampling.stop_token_ids", sp.stop_token_ids, vocab_size)
    validate_constraint(sp)


def validate_constraint(sp: pb.SamplingParams) -> None:
    """What can be checked without the grammar compiler (the worker runs it, and answers a
    constraint it refuses with INVALID_ARGUMENT and its message before any KV is used)."""
    kind = sp.WhichOneof("constraint")
    if kind is None:
        return
    field = f"sampling.{kind}"
    if kind == "json_object":
        if not sp.json_object:
            raise ValidationError(field, "must be true when set (leave it unset for no constraint)")
        return
    text: str = getattr(sp, kind)
    if not text.strip():
        raise ValidationError(field, "is empty")
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValidationError(field, f"at most {MAX_CONSTRAINT_CHARS} characters, got {len(text)}")
    if kind == "json_schema":
        _check_schema_json(field, text)


def _check_schema_json(field: str, text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValidationError(field, f"is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise ValidationError(
            field, f"a JSON Schema is an object or a boolean, got {type(schema).__name__}"
        )


def validate_input(req: pb.GenerateRequest | pb.TokenizeRequest, vocab_size: int) -> None:
    kind = req.WhichOneof("input")
    if kind is None:
        raise ValidationError("input", "one of text, input_ids or messages is required")
    if kind == "text" and not req.text:
        raise ValidationError("text", "the prompt is empty")
    if kind == "input_ids" and isinstance(req, pb.GenerateRequest):  # Tokenize has no ids
        if not req.input_ids.ids:
            raise ValidationError("input_ids", "the prompt is empty")
        _check_token_ids("input_ids.ids", req.input_ids.ids, vocab_size)
    if kind == "messages":
        if not req.messages.messages:
            raise ValidationError("messages", "at least one message is required")
        for i, m in enumerate(req.messages.messages):
            if m.role not in CHAT_ROLES:
                raise ValidationError(
                    f"messages[{i}].role", f"unknown role {m.role!r}; one of {sorted(CHAT_ROLES)}"
                )


def validate_request(req: pb.GenerateRequest, vocab_size: int) -> None:
    """Everything that can be checked before tokenizing."""
    if len(req.request_id) > MAX_REQUEST_ID_LEN:
        raise ValidationError("request_id", f"at most {MAX_REQUEST_ID_LEN} characters")
    if len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValidationError(
            "cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters, got {len(req.cache_salt)}"
        )
    validate_input(req, vocab_size)
    validate_sampling(req.sampling, vocab_size)


def validate_length(prompt_len: int, sp: pb.SamplingParams, max_model_len: int) -> None:
    """Prompt + max_tokens must fit in the context (an unset max_tokens is cut to fit later)."""
    if max_model_len <= 0:
        return  # not known yet: the scheduler still enforces it
    if prompt_len == 0:
        raise ValidationError("input", "the prompt is empty after tokenization")
    start = prompt_logprobs_start_problem(sp, prompt_len)
    if start is not None:
        raise ValidationError(*start)
    if prompt_len >= max_model_len:
        raise ValidationError(
            "input",
            f"the prompt has {prompt_len} tokens; "
            f"the model's context is {max_model_len} (max_model_len)",
        )
    if sp.HasField("max_tokens") and prompt_len + sp.max_tokens > max_model_len:
        raise ValidationError(
            "sampling.max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({sp.max_tokens}) "
            f"exceeds max_model_len {max_model_len}",
        )


def validate_text_size(req: pb.GenerateRequest | pb.TokenizeRequest, max_model_len: int) -> None:
    """Text (or chat content) too long to fit the context at any plausible token length."""
    if max_model_len <= 0:
        return
    kind = req.WhichOneof("input")
    if kind == "text":
        size, field = len(req.text), "text"
    elif kind == "messages":
        size, field = sum(len(m.content) for m in req.messages.messages), "messages"
    else:
        return
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if size > limit:
        raise ValidationError(
            field,
            f"{size} characters cannot fit max_model_len {max_model_len} tokens "
            f"(at most {limit} characters are tokenized)",
        )
