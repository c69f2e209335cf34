"""Server-sent events of a streamed answer, and a template for its text-only chunks.

Every chunk is sent as ``data: <json.dumps of model_dump(exclude_unset)>\\n\\n``: unset
fields absent, Python's default separators, non-ASCII characters as themselves. Nearly
every chunk of a stream differs from the one before only in its new text, and rendering it
the general way (pydantic models, model_dump, json.dumps) cost more per streamed token
than the incremental detokenizer. TextTemplate renders such a chunk once the general way
with a placeholder for the text, and fills in later texts as JSON strings: the same bytes,
an order of magnitude cheaper (docs/benchmarks-history.md, item 10).
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
    # Unset fields are absent rather than null (a chunk's usage, a later delta's role).
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
        """Splits the event of ``chunk_with_text(slot)`` at the slot; None when the slot is
        not there exactly once (another field happens to contain it)."""
        parts = events([chunk_with_text(_SLOT)]).split(_json_str(_SLOT))
        return cls(parts[0], parts[1]) if len(parts) == 2 else None

    def fill(self, text: str) -> str:
        return self._head + _json_str(text) + self._tail
