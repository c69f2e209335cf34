"""OpenAI's answers and stream chunks, built from GenerateResponses (``CompletionShape``,
``ChatShape``: what the shared completion path renders through).
"""

from __future__ import annotations

import copy
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from typing import Any

from pydantic import BaseModel

from radixserve.v1 import generation_pb2 as pb
from services.frontend import sse
from services.frontend.chat_tools import (
    ChatOutput,
)
from services.frontend.openai_protocol import CompletionRequest, one_prompt
from services.frontend.tokenizer import Tokenizer

# Answers and chunks are sent with exclude_unset: an unset field is absent, as in OpenAI's
# answers, not null.


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "radixserve"
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class CachedTokensDetails(BaseModel):
    """Where the cached prompt tokens came from (the hierarchical cache's tiers)."""

    device: int
    host: int
    storage: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int
    cached_tokens_details: CachedTokensDetails


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def total(cls, finals: Sequence[pb.GenerateResponse]) -> Usage:
        """n samples of one prompt: the prompt counted once, every sample's tokens counted."""
        usage = cls.of(finals[0])
        usage.completion_tokens = sum(f.completion_tokens for f in finals)
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return usage

    @classmethod
    def of(cls, final: pb.GenerateResponse) -> Usage:
        """From a request's last response, the only one that carries the counts."""
        return cls(
            prompt_tokens=final.prompt_tokens,
            completion_tokens=final.completion_tokens,
            total_tokens=final.prompt_tokens + final.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=final.cached_tokens,
                cached_tokens_details=CachedTokensDetails(
                    device=final.cached_tokens
                    - final.cached_tokens_details.host
                    - final.cached_tokens_details.storage,
                    host=final.cached_tokens_details.host,
                    storage=final.cached_tokens_details.storage,
                ),
            ),
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    # null for an echoed prompt's first token: nothing precedes it.
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]

    def __add__(self, other: CompletionLogprobs) -> CompletionLogprobs:
        return CompletionLogprobs(
            tokens=self.tokens + other.tokens,
            token_logprobs=self.token_logprobs + other.token_logprobs,
            top_logprobs=self.top_logprobs + other.top_logprobs,
        )


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class ChatDelta(BaseModel):
    role: str | None = None  # on the first chunk only
    content: str | None = None
    # With the parsers (chat_tools.py): the thinking, and calls as OpenAI's delta items.
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class CalledFunctionOut(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(BaseModel):
    id: str
    type: str = "function"
    function: CalledFunctionOut


class AssistantMessage(BaseModel):
    role: str
    content: str | None  # null when the answer is calls only
    reasoning_content: str | None = None  # set with --reasoning-parser
    tool_calls: list[ToolCallOut] | None = None  # set when calls were made


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class _Answer(BaseModel):
    id: str
    object: str
    created: int
    model: str


class Completion(_Answer):
    """A whole completions answer, and each of its stream's chunks (OpenAI uses one shape)."""

    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatCompletionChunk(_Answer):
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ChatCompletion(_Answer):
    choices: list[ChatChoice]
    usage: Usage


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    # Special tokens too: a logprob belongs to the token the model chose, whatever it is.
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer, lps: Sequence[pb.TokenLogprob]
) -> CompletionLogprobs | None:
    """Completions' logprobs: parallel lists, alternatives as {token: logprob}; None if none."""
    if not lps:
        return None
    return CompletionLogprobs(
        tokens=[_token_text(tokenizer, lp.token_id) for lp in lps],
        token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=[
            {_token_text(tokenizer, t.token_id): t.logprob for t in lp.top} for lp in lps
        ],
    )


def echo_logprobs(
    tokenizer: Tokenizer, first_token: int, prompt_lps: Sequence[pb.TokenLogprob]
) -> CompletionLogprobs:
    """An echoed prompt's logprobs: its first token has none (null), then one per token."""
    lead = CompletionLogprobs(
        tokens=[_token_text(tokenizer, first_token)], token_logprobs=[None], top_logprobs=[None]
    )
    rest = completion_logprobs(tokenizer, prompt_lps)
    return lead + rest if rest is not None else lead


def _chat_logprob(tokenizer: Tokenizer, token_id: int, logprob: float) -> ChatLogprob:
    token = _token_text(tokenizer, token_id)
    return ChatLogprob(token=token, logprob=logprob, bytes=list(token.encode()))


def _chat_token(tokenizer: Tokenizer, lp: pb.TokenLogprob) -> ChatTokenLogprob:
    token = _token_text(tokenizer, lp.token_id)
    top = [_chat_logprob(tokenizer, t.token_id, t.logprob) for t in lp.top]
    return ChatTokenLogprob(
        token=token, logprob=lp.logprob, bytes=list(token.encode()), top_logprobs=top
    )


def chat_logprobs(tokenizer: Tokenizer, lps: Sequence[pb.TokenLogprob]) -> ChatLogprobs | None:
    """Chat's logprobs: one entry per token, with its UTF-8 bytes; None if none were asked for."""
    if not lps:
        return None
    return ChatLogprobs(content=[_chat_token(tokenizer, lp) for lp in lps])


class _OpenAIShape(ABC):
    """One OpenAI answer in the making (a http_completion.Renderer): the id and creation time
    all its chunks share. With n samples each is rendered by a fork; this one sends the usage."""

    input_param: str  # the body field blamed for a bad prompt
    id_prefix: str  # of the answer's id
    chunk_object: str  # the ``object`` of the stream's chunks
    chunk_model: type[BaseModel]

    def __init__(self, tokenizer: Tokenizer, model: str, include_usage: bool) -> None:
        self._tokenizer = tokenizer
        self._include_usage = include_usage
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.index = 0  # the choice this renders

    def opening(self) -> list[BaseModel]:
        return []

    def fork(self, index: int) -> _OpenAIShape:
        """Choice ``index`` of the same answer: a copy with state of its own."""
        clone = copy.deepcopy(self, {id(self._tokenizer): self._tokenizer})
        clone.__dict__.pop("_text_template", None)  # it holds choice 0's index
        clone.index, clone._include_usage = index, False
        return clone

    def closing(self, finals: Sequence[pb.GenerateResponse]) -> list[BaseModel]:
        if not self._include_usage:
            return []
        usage = Usage.total(finals)
        return [self.chunk_model(**self._meta(self.chunk_object), choices=[], usage=usage)]

    def combine(
        self, answers: Sequence[BaseModel], wholes: Sequence[pb.GenerateResponse]
    ) -> dict[str, Any]:
        """The forks' answers as one: their choices in order, the usage of all."""
        body = sse.payload(answers[0])
        body["choices"] = []
        for new_index, i in enumerate(self._returned(wholes)):
            choice = sse.payload(answers[i])["choices"][0]
            body["choices"].append({**choice, "index": new_index})
        body["usage"] = Usage.total(wholes).model_dump()
        return body

    def _returned(self, wholes: Sequence[pb.GenerateResponse]) -> list[int]:
        return list(range(len(wholes)))

    def events(self, resp: pb.GenerateResponse) -> str:
        """The events of chunks(resp); a text-only chunk is filled into a template (faster)."""
        if resp.text and not (resp.finish_reason or resp.logprobs) and self._plain():
            template = self._text_template
            if template is not None:
                return template.fill(resp.text)
        return sse.events(self.chunks(resp))

    @cached_property
    def _text_template(self) -> sse.TextTemplate | None:
        # Built on first use: a subclass's own state must exist before _chunk runs.
        return sse.TextTemplate.of(lambda text: self._chunk(text, None, ()))

    def _plain(self) -> bool:
        """Whether a text-only response's chunk is the plain one (nothing leads its text)."""
        return True

    def chunks(self, resp: pb.GenerateResponse) -> list[BaseModel]:
        """The chunk of one response if it carries anything, then usage after the last."""
        out: list[BaseModel] = []
        if resp.text or resp.finish_reason or resp.logprobs:
            out.append(self._chunk(resp.text, resp.finish_reason or None, resp.logprobs))
        if resp.finish_reason and self._include_usage:
            usage = Usage.of(resp)
            out.append(self.chunk_model(**self._meta(self.chunk_object), choices=[], usage=usage))
        return out

    def _meta(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    @abstractmethod
    def _chunk(self, text: str, finish: str | None, lps: Sequence[pb.TokenLogprob]) -> BaseModel:
        """One stream chunk: new text, its logprobs, and the finish reason on the last."""

    @abstractmethod
    def whole(
        self, text: str, lps: Sequence[pb.TokenLogprob], final: pb.GenerateResponse
    ) -> BaseModel:
        """The answer to a request that did not ask to stream."""


class CompletionShape(_OpenAIShape):
    """``/v1/completions``: text choices, logprobs as parallel lists. With ``echo`` the
    prompt (and its logprobs, the first null) leads the first chunk or the whole answer."""

    input_param, id_prefix = "prompt", "cmpl"
    chunk_object, chunk_model = "text_completion", Completion

    def __init__(
        self,
        tokenizer: Tokenizer,
        model: str,
        include_usage: bool,
        echo: str | list[int] | None = None,
    ) -> None:
        super().__init__(tokenizer, model, include_usage)
        self._echo = echo  # the prompt still to echo; None when not asked or done
        self._lead: tuple[str, CompletionLogprobs | None] | None = None
        self._keep = 0  # best_of: the samples returned (0: all)
        self._show_logprobs = True  # False where only best_of asked for them

    @classmethod
    def of(cls, body: CompletionRequest, tokenizer: Tokenizer, model: str) -> CompletionShape:
        echo = one_prompt(body.prompt) if body.echo else None
        shape = cls(tokenizer, model, body.include_usage, echo)
        shape._keep, shape._show_logprobs = body.n, body.logprobs is not None
        return shape

    def _returned(self, wholes: Sequence[pb.GenerateResponse]) -> list[int]:
        """best_of: the n samples of highest cumulative logprob, best first."""
        order = list(range(len(wholes)))
        if not 0 < self._keep < len(wholes):
            return order
        score = [sum(lp.logprob for lp in whole.logprobs) for whole in wholes]
        return sorted(order, key=lambda i: -score[i])[: self._keep]

    def chunks(self, resp: pb.GenerateResponse) -> list[BaseModel]:
        self._take_echo(resp)  # the first response carries the prompt logprobs
        return super().chunks(resp)

    def _plain(self) -> bool:
        return self._echo is None and self._lead is None

    def _take_echo(self, first: pb.GenerateResponse) -> None:
        if self._echo is None:
            return
        prompt, self._echo = self._echo, None
        text = prompt if isinstance(prompt, str) else self._tokenizer.decode(prompt)
        logprobs = None
        if first.prompt_logprobs_start:  # asked (logprobs with echo)
            ids = prompt if isinstance(prompt, list) else self._tokenizer.encode(prompt)
            logprobs = echo_logprobs(self._tokenizer, ids[0], first.prompt_logprobs)
        self._lead = (text, logprobs)

    def _chunk(self, text: str, finish: str | None, lps: Sequence[pb.TokenLogprob]) -> Completion:
        logprobs = completion_logprobs(self._tokenizer, lps)
        if self._lead is not None:
            lead_text, lead_lps = self._lead
            self._lead = None
            text = lead_text + text
            if lead_lps is not None:
                logprobs = lead_lps + logprobs if logprobs is not None else lead_lps
        choice = CompletionChoice(
            index=self.index, text=text, logprobs=logprobs, finish_reason=finish
        )
        return Completion(**self._meta(self.chunk_object), choices=[choice])

    def whole(
        self, text: str, lps: Sequence[pb.TokenLogprob], final: pb.GenerateResponse
    ) -> Completion:
        self._take_echo(final)  # the merged responses: the prompt logprobs included
        answer = self._chunk(text, final.finish_reason, lps if self._show_logprobs else ())
        answer.usage = Usage.of(final)
        return answer


class ChatShape(_OpenAIShape):
    """``/v1/chat/completions``: a stream opens with the role, then carries content deltas.

    With ``output`` each reasoning, content or tool-call delta gets a chunk, and an empty
    delta holds the finish reason ("tool_calls" instead of "stop" when calls were made)."""

    input_param, id_prefix = "messages", "chatcmpl"
    chunk_object, chunk_model = "chat.completion.chunk", ChatCompletionChunk

    def __init__(
        self,
        tokenizer: Tokenizer,
        model: str,
        include_usage: bool,
        output: ChatOutput | None = None,
    ) -> None:
        super().__init__(tokenizer, model, include_usage)
        self._output = output

    def _plain(self) -> bool:
        return self._output is None

    def chunks(self, resp: pb.GenerateResponse) -> list[BaseModel]:
        if self._output is None:
            return super().chunks(resp)
        deltas = self._output.feed(resp.text)
        if resp.finish_reason:
            deltas += self._output.finish()
        logprobs = chat_logprobs(self._tokenizer, resp.logprobs)
        out: list[BaseModel] = []
        for delta in deltas or ([{}] if logprobs else []):  # logprobs need a chunk
            out.append(self._delta_chunk(ChatDelta(**delta), None, logprobs))
            logprobs = None
        if resp.finish_reason:
            out.append(self._delta_chunk(ChatDelta(), self._finish(resp.finish_reason), None))
            if self._include_usage:
                usage = Usage.of(resp)
                out.append(
                    self.chunk_model(**self._meta(self.chunk_object), choices=[], usage=usage)
                )
        return out

    def _finish(self, reason: str) -> str:
        called = self._output is not None and self._output.tool_calls
        return "tool_calls" if called and reason == "stop" else reason

    def opening(self) -> list[BaseModel]:
        return [self._delta_chunk(ChatDelta(role="assistant", content=""), None, None)]

    def _chunk(
        self, text: str, finish: str | None, lps: Sequence[pb.TokenLogprob]
    ) -> ChatCompletionChunk:
        logprobs = chat_logprobs(self._tokenizer, lps)
        return self._delta_chunk(ChatDelta(content=text), finish, logprobs)

    def _delta_chunk(
        self, delta: ChatDelta, finish: str | None, logprobs: ChatLogprobs | None
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(
            index=self.index, delta=delta, logprobs=logprobs, finish_reason=finish
        )
        return ChatCompletionChunk(**self._meta(self.chunk_object), choices=[choice])

    def whole(
        self, text: str, lps: Sequence[pb.TokenLogprob], final: pb.GenerateResponse
    ) -> ChatCompletion:
        message = self._message(text)  # first: the finish reason depends on its calls
        choice = ChatChoice(
            index=self.index,
            message=message,
            logprobs=chat_logprobs(self._tokenizer, lps),
            finish_reason=self._finish(final.finish_reason),
        )
        meta = self._meta("chat.completion")
        return ChatCompletion(**meta, choices=[choice], usage=Usage.of(final))

    def _message(self, text: str) -> AssistantMessage:
        if self._output is None:
            return AssistantMessage(role="assistant", content=text)
        parsed = self._output.whole(text)
        message = AssistantMessage(
            role="assistant",
            content=None if parsed.tool_calls and not parsed.content.strip() else parsed.content,
        )
        if parsed.reasoning is not None:
            message.reasoning_content = parsed.reasoning or None
        if parsed.tool_calls:
            message.tool_calls = [ToolCallOut(**c.to_openai()) for c in parsed.tool_calls]
        return message
