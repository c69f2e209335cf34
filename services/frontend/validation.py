"""Request validation: every field checked against the limits generation.proto documents.

Errors name the field by its path in GenerateRequest (``sampling.top_p``) and state the
limit, so the gRPC layer answers INVALID_ARGUMENT and the HTTP layer can map the field to
the OpenAI parameter.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from radixserve.v1 import generation_pb2 as pb
from services.common.sampling_limits import (
    DEFAULT_MAX_TOKENS,
    prompt_logprobs_start_problem,
    sampling_bound_problem,
)
from services.frontend.stop_strings import compile_stop_regex
from services.frontend.tool_grammar import MAX_TOOLS, TOOL_NAME

MAX_STOP_STRINGS = 16
# A prompt longer than max_model_len * this many characters cannot fit the context, so it is
# refused before tokenizing (which costs seconds for megabytes of text).
MAX_CHARS_PER_TOKEN = 64
MAX_STOP_STRING_CHARS = 1024  # stop strings are matched against every streamed chunk
MAX_CACHE_SALT_CHARS = 1024  # salts are kept in the radix tree, one per cached branch
MAX_STOP_TOKEN_IDS = 64
# Stop regexes (SGLang's limits): each is searched in up to ~2k characters per piece.
MAX_STOP_REGEX = 32
MAX_STOP_REGEX_CHARS = 256
MAX_REQUEST_ID_LEN = 256
# Samples of one prompt (GenerateRequest.n) at most: each is a request in the engine.
MAX_SAMPLES = 128
# A constraint's characters at most: refused before the engine spends a compile on it.
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
    _check_stop_regex(sp.stop_regex)
    for e in sp.logit_bias:  # the count, the range and repeats: sampling_bound_problem
        if not 0 <= e.token_id < vocab_size:
            raise ValidationError(
                "sampling.logit_bias",
                f"token id {e.token_id} is outside the vocabulary [0, {vocab_size})",
            )
    validate_constraint(sp)


def _check_stop_regex(patterns: Sequence[str]) -> None:
    if len(patterns) > MAX_STOP_REGEX:
        raise ValidationError(
            "sampling.stop_regex", f"at most {MAX_STOP_REGEX} patterns, got {len(patterns)}"
        )
    for i, p in enumerate(patterns):
        if len(p) > MAX_STOP_REGEX_CHARS:
            raise ValidationError(
                f"sampling.stop_regex[{i}]",
                f"at most {MAX_STOP_REGEX_CHARS} characters, got {len(p)}",
            )
        try:
            compile_stop_regex(p)
        except ValueError as e:
            raise ValidationError(f"sampling.stop_regex[{i}]", str(e)) from None


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
    elif kind == "structural_tag":
        _check_structural_tag_json(field, text)


def _json(field: str, text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValidationError(field, f"is not valid JSON: {e}") from None


def _check_schema_json(field: str, text: str) -> None:
    schema = _json(field, text)
    if not isinstance(schema, dict | bool):
        raise ValidationError(
            field, f"a JSON Schema is an object or a boolean, got {type(schema).__name__}"
        )


def _check_structural_tag_json(field: str, text: str) -> None:
    """Its shape only; what the formats inside mean is the grammar compiler's to judge."""
    tag = _json(field, text)
    if not isinstance(tag, dict):
        raise ValidationError(field, f"a structural tag is a JSON object, got {type(tag).__name__}")
    if "format" not in tag and "structures" not in tag:
        raise ValidationError(field, 'needs "format" (or the older "structures" and "triggers")')


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
            _check_tool_calls(f"messages[{i}]", m)
        _check_tools(req.messages.tools)


def _check_tool_calls(where: str, m: pb.ChatMessage) -> None:
    if m.tool_calls and m.role != "assistant":
        raise ValidationError(
            f"{where}.tool_calls", f"only assistant messages make calls, not {m.role!r}"
        )
    for j, call in enumerate(m.tool_calls):
        field = f"{where}.tool_calls[{j}]"
        if not call.name:
            raise ValidationError(f"{field}.name", "the function's name is required")
        _json_object(f"{field}.arguments", call.arguments)


def _check_tools(tools: Sequence[pb.Tool]) -> None:
    """The rules of tool_grammar.function_schemas, for callers that skip the HTTP layer."""
    if len(tools) > MAX_TOOLS:
        raise ValidationError("messages.tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        field = f"messages.tools[{i}]"
        if not TOOL_NAME.fullmatch(tool.name):
            raise ValidationError(
                f"{field}.name", f"must be 1 to 64 of a-z, A-Z, 0-9, _, ., -; got {tool.name!r}"
            )
        if tool.name in seen:
            raise ValidationError(f"{field}.name", f"function {tool.name!r} is given twice")
        seen.add(tool.name)
        if tool.parameters:
            _json_object(f"{field}.parameters", tool.parameters)


def _json_object(field: str, text: str) -> None:
    if not isinstance(_json(field, text), dict):
        raise ValidationError(field, "must be a JSON object")


def validate_request(req: pb.GenerateRequest, vocab_size: int) -> None:
    """Everything that can be checked before tokenizing."""
    if len(req.request_id) > MAX_REQUEST_ID_LEN:
        raise ValidationError("request_id", f"at most {MAX_REQUEST_ID_LEN} characters")
    if len(req.cache_salt) > MAX_CACHE_SALT_CHARS:
        raise ValidationError(
            "cache_salt", f"at most {MAX_CACHE_SALT_CHARS} characters, got {len(req.cache_salt)}"
        )
    if not 0 <= req.n <= MAX_SAMPLES:
        raise ValidationError("n", f"must be in [1, {MAX_SAMPLES}], got {req.n}")
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


def validate_samples(
    n: int, prompt_len: int, sp: pb.SamplingParams, max_model_len: int, pool_tokens: int
) -> None:
    """n samples run side by side on one engine: the prompt's KV (shared) and each one's
    max_tokens must fit its pool at once. 0 for a limit not known yet: not checked."""
    if n <= 1 or pool_tokens <= 0:
        return
    each = sp.max_tokens if sp.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if max_model_len > 0:
        each = min(each, max_model_len - prompt_len)  # the context ends a sample there
    need = prompt_len + n * each
    if need > pool_tokens:
        raise ValidationError(
            "n",
            f"{n} samples of up to {each} tokens after the prompt ({prompt_len} tokens) need "
            f"{need} KV slots; the engine's pool holds {pool_tokens}",
        )


def validate_text_size(req: pb.GenerateRequest | pb.TokenizeRequest, max_model_len: int) -> None:
    """Text (or chat content) too long to fit the context at any plausible token length."""
    if max_model_len <= 0:
        return
    kind = req.WhichOneof("input")
    if kind == "text":
        size, field = len(req.text), "text"
    elif kind == "messages":
        size, field = _chat_size(req.messages), "messages"
    else:
        return
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if size > limit:
        raise ValidationError(
            field,
            f"{size} characters cannot fit max_model_len {max_model_len} tokens "
            f"(at most {limit} characters are tokenized)",
        )


def _chat_size(chat: pb.ChatMessages) -> int:
    """Characters of the chat that the template renders: contents, calls and tools."""
    calls = sum(len(c.name) + len(c.arguments) for m in chat.messages for c in m.tool_calls)
    tools = sum(len(t.name) + len(t.description) + len(t.parameters) for t in chat.tools)
    return sum(len(m.content) for m in chat.messages) + calls + tools
