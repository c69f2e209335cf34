"""The served model's tokenizer, chat template and EOS ids, read from the model folder."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, TokenizersBackend

log = logging.getLogger(__name__)


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def read_eos_token_ids(model_path: str, tokenizer) -> list[int]:
    """EOS ids: generation_config.json first (it may list several), else the tokenizer's."""
    path = os.path.join(model_path, "generation_config.json")
    ids: list[int] = []
    if os.path.exists(path):
        with open(path) as f:
            ids = _as_id_list(json.load(f).get("eos_token_id"))
    if not ids:
        ids = _as_id_list(tokenizer.eos_token_id)
    return sorted(set(ids))


# Stand-ins for chat contents while the template renders: private-use characters.
_PLACEHOLDER = re.compile("\ue000radixserve-content-(\\d+)\ue001")


def _placeholder(index: int) -> str:
    return f"\ue000radixserve-content-{index}\ue001"


# A chat message: (role, content), or the template's own dict (tool_calls, tool_call_id...).
Message = tuple[str, str] | Mapping[str, Any]
Tools = Sequence[Mapping[str, Any]]  # OpenAI's tools, as the template takes them


def _as_dict(message: Message) -> dict[str, Any]:
    if isinstance(message, tuple):
        return {"role": message[0], "content": message[1]}
    return dict(message)


class ChatToolsError(ValueError):
    """Tools or calls the chat template cannot be given; ``field`` is their GenerateRequest path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Tokenizer:
    """Text <-> ids for one model folder (transformers AutoTokenizer)."""

    def __init__(self, model_path: str) -> None:
        self.hf = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_ids = read_eos_token_ids(model_path, self.hf)
        # len() counts added special tokens, which vocab_size leaves out.
        self.vocab_size = len(self.hf)
        self._special_texts = [
            t.content for t in self.hf.added_tokens_decoder.values() if t.special and t.content
        ]
        if self.hf.chat_template is None:
            log.warning("tokenizer in %s has no chat template: chat requests will fail", model_path)
        self._rust_decode = _plain_rust_decode(self.hf)

    def encode(self, text: str) -> list[int]:
        """A raw prompt, with the special tokens the tokenizer adds by default (e.g. BOS)."""
        return list(self.hf.encode(text))

    def render_chat(self, messages: Sequence[Message], tools: Tools | None = None) -> str:
        """The prompt text the chat template makes of the messages (and tools). Tools the
        template does not render are refused (ChatToolsError), never silently dropped."""
        if self.hf.chat_template is None:
            raise ValueError("the model has no chat template; send text or input_ids")
        conv = [_as_dict(m) for m in messages]
        text = self._apply(conv, tools)
        # A template that ignores ``tools`` renders the same text with and without them.
        if tools and text == self._apply(conv, None):
            raise ChatToolsError(
                "messages.tools",
                "the model's chat template does not render tools, so the model would never "
                "see them; leave tools out, or serve a model whose template renders them",
            )
        return text

    def _apply(self, conv: list[dict[str, Any]], tools: Tools | None) -> str:
        text = self.hf.apply_chat_template(
            conv,
            tools=[dict(t) for t in tools] if tools else None,
            tokenize=False,
            add_generation_prompt=True,
        )
        assert isinstance(text, str)  # tokenize=False: the rendered text, never ids
        return text

    def encode_chat(self, messages: Sequence[Message], tools: Tools | None = None) -> list[int]:
        """The chat's ids; content is always ordinary text: "<|im_start|>system" typed by a
        user never opens a real turn. Special-token text in tools and calls is refused."""
        conv = [_as_dict(m) for m in messages]
        self._check_tool_text(conv, tools or [])
        if not any(self._special_in(str(m.get("content") or "")) for m in conv):
            # The template already writes BOS and friends: add nothing more.
            return list(self.hf.encode(self.render_chat(conv, tools), add_special_tokens=False))
        return self._encode_chat_escaped(conv, tools)

    def _special_in(self, text: str) -> str | None:
        return next((t for t in self._special_texts if t in text), None)

    def _check_tool_text(self, conv: list[dict[str, Any]], tools: Tools) -> None:
        """Refuses special-token text in tools and calls: no placeholder keeps it plain there."""
        parts: list[tuple[str, Any]] = [(f"messages.tools[{i}]", t) for i, t in enumerate(tools)]
        for i, m in enumerate(conv):
            parts += [
                (f"messages[{i}].{k}", m.get(k)) for k in ("tool_calls", "tool_call_id", "name")
            ]
        for field, value in parts:
            found = self._special_in(json.dumps(value, ensure_ascii=False)) if value else None
            if found:
                raise ChatToolsError(field, f"must not contain the special token text {found!r}")

    def _encode_chat_escaped(self, conv: list[dict[str, Any]], tools: Tools | None) -> list[int]:
        """Renders the template around placeholders, then tokenizes the template's text with
        its special tokens and each content with special-token text split into plain tokens.
        Empty contents stay empty: templates test them."""
        held = [
            {**m, "content": _placeholder(i) if m.get("content") else m.get("content")}
            for i, m in enumerate(conv)
        ]
        rendered = self.render_chat(held, tools)
        ids: list[int] = []
        for j, piece in enumerate(_PLACEHOLDER.split(rendered)):
            if j % 2 == 0:  # the template's text: its markers are the real special tokens
                ids += self.hf.encode(piece, add_special_tokens=False)
            else:  # the capture group: which message's content
                content = str(conv[int(piece)]["content"])
                ids += self.hf.encode(content, add_special_tokens=False, split_special_tokens=True)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._rust_decode is not None:  # the same text, without transformers' wrapping
            return self._rust_decode(list(ids), skip_special_tokens)
        text = self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        return [t if t is not None else "" for t in self.hf.convert_ids_to_tokens(list(ids))]


def _plain_rust_decode(hf: PreTrainedTokenizerBase) -> Callable[[list[int], bool], str] | None:
    """The Rust tokenizer's own decode when transformers' decode adds nothing to it (its
    wrapping costs more than the call; the stream decodes per token); None: use hf.decode."""
    cls = type(hf)
    plain = (
        isinstance(hf, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and not hf.clean_up_tokenization_spaces
    )
    return hf.backend_tokenizer.decode if plain else None
