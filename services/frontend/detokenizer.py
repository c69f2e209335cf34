"""Incremental detokenization that never emits half a UTF-8 character.

The prefix/read offset method: a window starting a few tokens back (``prefix_offset``) gives
the tokenizer context to place spaces right; the text new since ``read_offset`` is emitted
once the window's text does not end with U+FFFD (an unfinished UTF-8 sequence).
"""

from __future__ import annotations

from collections.abc import Sequence

from services.frontend.tokenizer import Tokenizer

# Prompt tokens kept as context before the first output token (leading-space handling).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        if context and self._tok.decode(context, skip_special_tokens=skip_special_tokens).endswith(
            REPLACEMENT_CHAR
        ):
            # A prompt ending mid-character would swallow the output's first bytes.
            context = []
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def _pending_text(self, final: bool) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing new, or an unfinished character: wait for more tokens
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def add(self, token_ids: Sequence[int]) -> str:
        """Appends tokens; returns the text that became final (maybe "")."""
        self._ids.extend(token_ids)
        return self._pending_text(final=False)

    def flush(self) -> str:
        """At the end of the request: whatever is left, unfinished characters included."""
        return self._pending_text(final=True)
