"""Server-sent events of a streamed answer, and a template for its text-only chunks.

Nearly every chunk differs from the last only in its text, and rendering it through pydantic
and json.dumps cost more per token than detokenizing. TextTemplate renders such a chunk once
with a placeholder and fills later texts in as JSON strings: the same bytes, far cheaper.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel

# The text a template is rendered with: plain ASCII, so JSON leaves it as it is.
_SLOT = "radixserve-text-slot-5f0c"
# json.dumps(text, ensure_ascii=False) without building an encoder per call.
_json_str: Callable[[str], str] = json.JSONEncoder(ensure_ascii=False).encode


def payload(answer: BaseModel) -> dict[str, Any]:
    return answer.model_dump(exclude_unset=True)


def data_event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def events(chunks: Iterable[BaseModel]) -> str:
    """The chunks as consecutive events ("" for none)."""
    return "".join(data_event(payload(chunk)) for chunk in chunks)


class TextTemplate:
    """The event of a chunk that differs from a reference chunk only in one text field."""

    def __init__(self, head: str, tail: str) -> None:
        self._head, self._tail = head, tail

    @classmethod
    def of(cls, chunk_with_text: Callable[[str], BaseModel]) -> TextTemplate | None:
        """Splits the event of ``chunk_with_text(slot)`` at the slot (None: not there once)."""
        parts = events([chunk_with_text(_SLOT)]).split(_json_str(_SLOT))
        return cls(parts[0], parts[1]) if len(parts) == 2 else None

    def fill(self, text: str) -> str:
        return self._head + _json_str(text) + self._tail
