"""Keyword arguments -> radixserve.v1 request messages (shared by Client and AsyncClient)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from radixserve.client.structured import OutputSpec
from radixserve.v1 import generation_pb2 as pb

# A prompt: text as is, a chat ([{"role": "user", "content": "..."}], rendered with the
# model's chat template), or token ids.
Prompt = str | Sequence[Mapping[str, str]] | Sequence[int]


class GenerateOptions(TypedDict, total=False):
    """Keyword options of ``generate`` and ``stream``. Unset ones take the server's default
    (max_tokens 128, temperature 1.0, ...; see protos/radixserve/v1/generation.proto)."""

    max_tokens: int  # 0: the prompt only (its prompt_logprobs, its KV in the cache)
    min_tokens: int  # EOS and stop_token_ids cannot end the output before this many tokens
    temperature: float  # 0 = greedy
    top_p: float
    top_k: int
    min_p: float
    seed: int  # the same seed gives the same tokens
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    stop: str | Sequence[str]  # the text is cut before the match
    stop_regex: str | Sequence[str]  # Python regular expressions; cut as stop strings are
    stop_token_ids: Sequence[int]
    logit_bias: Mapping[int, float]  # token id -> bias in [-100, 100], added to its logit
    ignore_eos: bool
    disable_speculation: bool  # no speculative decoding for this request (same output)
    logprobs: bool  # the logprob of each chosen token
    top_logprobs: int  # and this many alternatives (implies logprobs)
    prompt_logprobs: bool  # the logprob of each prompt token (Completion.prompt_logprobs)
    prompt_logprobs_start: int  # from this prompt position on (default 0, effectively 1)
    regex: str  # the output fully matches this regular expression
    ebnf: str  # the output follows this GBNF grammar (root rule "root")
    json_object: bool  # the output is some JSON object
    structural_tag: str  # xgrammar structural-tag JSON: free text with constrained tags
    priority: int
    cache_salt: str  # requests with different salts never share cached KV
    request_id: str
    timeout: float  # seconds for the whole call, instead of the client's timeout


def _is_scalar(f: Any) -> bool:
    """A single value of its own: not repeated, not a message, in no oneof but its own
    (proto3 ``optional`` makes a one-member oneof named after the field)."""
    oneof = f.containing_oneof
    own = oneof is None or oneof.name == f"_{f.name}"
    return own and not f.is_repeated and f.message_type is None


# Options set as-is on SamplingParams: its scalar fields of the same name.
_SAMPLING_SCALARS = tuple(
    f.name
    for f in pb.SamplingParams.DESCRIPTOR.fields
    if f.name in GenerateOptions.__optional_keys__ and _is_scalar(f)
)
_KNOWN = frozenset(GenerateOptions.__optional_keys__)


def check_options(options: Mapping[str, object]) -> None:
    unknown = sorted(set(options) - _KNOWN)
    if unknown:
        known = ", ".join(sorted(_KNOWN))
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; known: {known}")


def generate_request(
    prompt: Prompt, spec: OutputSpec[Any] | None, options: GenerateOptions
) -> pb.GenerateRequest:
    """The GenerateRequest for ``prompt``; TypeError/ValueError for misuse found before sending."""
    check_options(options)
    req = pb.GenerateRequest(
        request_id=options.get("request_id", ""),
        sampling=_sampling(spec, options),
        priority=options.get("priority", 0),
        cache_salt=options.get("cache_salt", ""),
    )
    _set_prompt(req, prompt)
    return req


def tokenize_request(prompt: str | Sequence[Mapping[str, str]]) -> pb.TokenizeRequest:
    req = pb.TokenizeRequest()
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.messages.CopyFrom(_chat(prompt))
    return req


def _sampling(spec: OutputSpec[Any] | None, options: GenerateOptions) -> pb.SamplingParams:
    sp = pb.SamplingParams()
    for name in _SAMPLING_SCALARS:
        value = options.get(name)
        if value is not None:
            setattr(sp, name, value)
    if options.get("top_logprobs") is not None:
        sp.logprobs = True
    stop = options.get("stop")
    if stop is not None:
        sp.stop.extend([stop] if isinstance(stop, str) else stop)
    regexes = options.get("stop_regex")
    if regexes is not None:
        sp.stop_regex.extend([regexes] if isinstance(regexes, str) else regexes)
    sp.stop_token_ids.extend(options.get("stop_token_ids", ()))
    bias = options.get("logit_bias", {})
    sp.logit_bias.extend(pb.LogitBias(token_id=t, bias=b) for t, b in bias.items())
    _set_constraint(sp, spec, options)
    return sp


def _set_constraint(
    sp: pb.SamplingParams, spec: OutputSpec[Any] | None, options: GenerateOptions
) -> None:
    """At most one constraint: the proto's oneof would silently keep only the last one set."""
    given = {
        "structured_output": spec is not None,
        "regex": options.get("regex") is not None,
        "ebnf": options.get("ebnf") is not None,
        "json_object": bool(options.get("json_object")),
        "structural_tag": options.get("structural_tag") is not None,
    }
    chosen = [name for name, on in given.items() if on]
    if len(chosen) > 1:
        raise ValueError(f"give at most one constraint, not {' and '.join(chosen)}")
    if spec is not None:
        sp.json_schema = spec.schema_text
    elif (regex := options.get("regex")) is not None:
        sp.regex = regex
    elif (ebnf := options.get("ebnf")) is not None:
        sp.ebnf = ebnf
    elif options.get("json_object"):
        sp.json_object = True
    elif (tag := options.get("structural_tag")) is not None:
        sp.structural_tag = tag


def _set_prompt(req: pb.GenerateRequest, prompt: Prompt) -> None:
    if isinstance(prompt, str):
        req.text = prompt
    elif not prompt:
        raise ValueError("the prompt is empty")
    elif all(isinstance(t, int) for t in prompt):
        req.input_ids.ids.extend(prompt)  # type: ignore[arg-type]
    else:
        req.messages.CopyFrom(_chat(prompt))  # type: ignore[arg-type]


def _chat(messages: Sequence[Mapping[str, str]]) -> pb.ChatMessages:
    out = pb.ChatMessages()
    for m in messages:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise TypeError(f"a chat message is a dict with 'role' and 'content', got {m!r}")
        out.messages.add(role=m["role"], content=m["content"])
    return out
