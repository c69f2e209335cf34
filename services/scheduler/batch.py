"""One request's share of a forward batch, as the batch builders hand it to the worker link.

An item covers positions [start, start + n); the builder grew the KV first, so
``start = kv_len - n``. A decode item's k drafts follow its last token (n = 1 + k).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.request import Req


@dataclass(frozen=True, kw_only=True, slots=True)
class Item:
    req: Req
    start: int  # position of the first token computed
    n: int  # tokens computed
    sample: bool  # the worker samples a token after the last one
    is_prefill: bool
    from_last: bool = False  # input = the token the worker sampled in the batch before (overlap)
    drafts: tuple[int, ...] = ()  # tokens to verify after the last one (speculative decoding)

    @property
    def n_real(self) -> int:
        return self.n - len(self.drafts)

    @classmethod
    def prefill(cls, req: Req, n: int) -> Item:
        """The last n positions the request just grew KV for (a whole prompt or a chunk)."""
        return cls(
            req=req,
            start=req.kv_len - n,
            n=n,
            sample=req.kv_len == req.seq_len and not req.prefill_only,
            is_prefill=True,
        )

    @classmethod
    def decode(cls, req: Req, *, from_last: bool = False, drafts: tuple[int, ...] = ()) -> Item:
        """One decode step of a request that just grew 1 + len(drafts) KV slots."""
        n = 1 + len(drafts)
        return cls(
            req=req,
            start=req.kv_len - n,
            n=n,
            sample=not req.prefill_only,
            is_prefill=False,
            from_last=from_last,
            drafts=drafts,
        )


def is_decode(items: list[Item]) -> bool:
    """A batch of one-token decode steps only (no prefill, no drafts)."""
    return not any(it.is_prefill or it.drafts for it in items)
