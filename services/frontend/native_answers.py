"""SGLang's answers to /generate and its stream events, built from GenerateResponses
(``NativeShape``: the Renderer the shared completion path renders through).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from radixserve.v1 import generation_pb2 as pb
from services.frontend import sse
from services.frontend.native_protocol import NativeItem
from services.frontend.tokenizer import Tokenizer


class NativeOutput(BaseModel):
    """One prompt's answer, or one event of its stream (text and ids so far)."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    index: int | None = None  # the sample's, with n > 1 (set only then, as SGLang does)


Entry = list[Any]  # [logprob or null, token id, token text or null]


class NativeShape:
    """SGLang's shape of one generation (a http_completion Renderer). A stream's events carry
    the text and ids so far, as SGLang's client reads them, not the new piece."""

    def __init__(self, tokenizer: Tokenizer, item: NativeItem, first_id: int | None = None) -> None:
        self.input_param = item.input_param
        self._tok = tokenizer
        self._ask = item.ask
        self._stops = {*item.req.sampling.stop, *item.req.sampling.stop_regex}
        self._first_id = first_id  # prompt token 0, for its null entry (start 0 only)
        self._item = item
        self._index: int | None = None  # a fork's sample (n > 1)
        self._text = ""
        self._ids: list[int] = []
        self._out_lps: list[pb.TokenLogprob] = []
        self._prompt_lps: list[pb.TokenLogprob] = []

    def opening(self) -> list[BaseModel]:
        return []

    def fork(self, index: int) -> NativeShape:
        shape = NativeShape(self._tok, self._item, self._first_id)
        shape._index = index
        return shape

    def closing(self, finals: Sequence[pb.GenerateResponse]) -> list[BaseModel]:
        return []

    def combine(
        self, answers: Sequence[BaseModel], wholes: Sequence[pb.GenerateResponse]
    ) -> list[dict[str, Any]]:
        """n samples: a list of n outputs, as SGLang answers them."""
        return [sse.payload(a) for a in answers]

    def chunks(self, resp: pb.GenerateResponse) -> list[BaseModel]:
        self._add(resp)
        if not (resp.text or resp.token_ids or resp.finish_reason):
            return []
        return [self._output(resp)]

    def events(self, resp: pb.GenerateResponse) -> str:
        # Every event repeats the text so far: no template fits them.
        return sse.events(self.chunks(resp))

    def whole(
        self, text: str, lps: Sequence[pb.TokenLogprob], final: pb.GenerateResponse
    ) -> BaseModel:
        self._add(final)
        self._text = text
        return self._output(final)

    def _add(self, resp: pb.GenerateResponse) -> None:
        self._text += resp.text
        self._ids.extend(resp.token_ids)
        self._out_lps.extend(resp.logprobs)
        self._prompt_lps.extend(resp.prompt_logprobs)

    def _output(self, resp: pb.GenerateResponse) -> NativeOutput:
        meta: dict[str, Any] = {"id": resp.request_id, "finish_reason": None}
        if resp.finish_reason:
            meta["finish_reason"] = self._finish(resp)
            meta["prompt_tokens"] = resp.prompt_tokens
        if self._ask.return_logprob:
            meta.update(self._logprobs())
        meta["completion_tokens"] = resp.completion_tokens or len(self._ids)
        if resp.finish_reason:
            meta["cached_tokens"] = resp.cached_tokens
            d = resp.cached_tokens_details
            meta["cached_tokens_details"] = {
                "device": resp.cached_tokens - d.host - d.storage, "host": d.host,
                "storage": d.storage,
            }  # fmt: skip
            meta["e2e_latency"] = resp.timings.total_time
        out = NativeOutput(text=self._text, output_ids=list(self._ids), meta_info=meta)
        if self._index is not None:
            out.index = self._index
        return out

    def _finish(self, resp: pb.GenerateResponse) -> dict[str, Any]:
        """SGLang's finish reasons: a matched stop string as text, a stop token as its id."""
        if resp.finish_reason == "length":
            return {"type": "length", "length": resp.completion_tokens}
        if resp.finish_reason == "stop":
            matched: str | int | None = None
            if resp.matched_stop in self._stops:
                matched = resp.matched_stop
            elif resp.matched_stop and self._ids:
                matched = self._ids[-1]  # the stop token ends the output
            return {"type": "stop", "matched": matched}
        return {"type": "abort", "message": resp.matched_stop or "the request was aborted"}

    def _logprobs(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "input_token_logprobs": self._prompt_entries(),
            "output_token_logprobs": [self._entry(lp.logprob, lp.token_id) for lp in self._out_lps],
        }
        if self._ask.top_logprobs_num > 0:
            out["input_top_logprobs"] = self._prompt_tops()
            out["output_top_logprobs"] = [self._tops(lp) for lp in self._out_lps]
        return out

    def _prompt_entries(self) -> list[Entry]:
        """From logprob_start_len on; position 0 has no logit, so its logprob is null."""
        if not self._ask.prompt:
            return []
        entries = [self._entry(lp.logprob, lp.token_id) for lp in self._prompt_lps]
        if self._ask.logprob_start_len == 0 and self._first_id is not None:
            entries.insert(0, self._entry(None, self._first_id))
        return entries

    def _prompt_tops(self) -> list[list[Entry] | None]:
        if not self._ask.prompt:
            return []
        tops: list[list[Entry] | None] = [self._tops(lp) for lp in self._prompt_lps]
        if self._ask.logprob_start_len == 0 and self._first_id is not None:
            tops.insert(0, None)
        return tops

    def _tops(self, lp: pb.TokenLogprob) -> list[Entry]:
        return [self._entry(t.logprob, t.token_id) for t in lp.top]

    def _entry(self, logprob: float | None, token_id: int) -> Entry:
        text = None
        if self._ask.return_text_in_logprobs:
            text = self._tok.decode([token_id], skip_special_tokens=False)
        return [logprob, token_id, text]
