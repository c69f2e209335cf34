"""One request's share of a forward batch, as the batch builders hand it to the worker link.

Positions of the request that an item covers (``fill_ids = input_ids + output_ids``):

    position:  0 .............. start ............... start + n ...... seq_len
    kv_slots:  [ KV written before | written by this batch ]
                                     out_slots = kv_slots[start : start + n]

``kv_slots`` already has ``start + n`` entries when the item is built (the builder grew
them first), so ``start = kv_len - n``. ``sample`` is set when the item reaches the end of
the sequence: only then do the logits of its last position give the next token (never
with max_tokens 0: that request ends after its prefill).

A decode item with drafts (speculative decoding, speculative.py) computes its last token
and the k drafts after it, which are not in ``fill_ids`` (yet):

    position:  start (= seq_len - 1)   start + 1 .. start + k
    token:     fill_ids[start]         drafts[0] .. drafts[k-1]       n = 1 + k
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.request import Req


@dataclass(frozen=True, kw_only=True, slots=True)
class Item:
    """One request's share of a batch."""

    req: Req
    start: int  # position of the first token computed
    n: int  # tokens computed
    sample: bool  # the worker samples a token after the last one
    is_prefill: bool
    from_last: bool = False  # input = the token the worker sampled in the batch before (overlap)
    drafts: tuple[int, ...] = ()  # tokens to verify after the last one (speculative decoding)

    @property
    def n_real(self) -> int:
        """Positions computed from fill_ids (the rest are drafts)."""
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
        """One decode step of a request that just grew one KV slot (1 + len(drafts) with
        drafts): position kv_len - 1 - len(drafts). (Also a prompt's last token when only it
        lacks KV: then a max_tokens 0 request samples nothing.)"""
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
    """A batch of one-token decode steps only (no prefill chunk, no drafts in it)."""
    return not any(it.is_prefill or it.drafts for it in items)
