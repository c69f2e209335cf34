"""The benchmark's workloads: which prompts are sent, in which groups, in which order.

Prompts are random words from a seeded generator: repeatable, and a new seed gives texts no
server has cached. With a tokenizer each piece is cut to an exact token count, else a word is
about one token. A workload is a list of sessions (conversations); in multi-turn ones each
prompt is the previous prompt, the server's answer and the new message.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORDS = """
time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force
education foot boy age policy music market sense nation plan college interest death
experience effect use class control care field development role effort rate heart drug
show leader light voice wife police mind price report decision son view relationship town
road arm difference value building action model season society tax director position
player record paper space ground form event official matter center couple site project
activity star table need court oil situation cost industry figure street image phone data
picture practice piece land product doctor wall patient worker news test movie north love
support technology step baby computer type attention film tree source organization hair
window evidence population truth song network river garden stone bridge cloud engine
green quiet simple rapid gentle bright heavy early modern local single common strong
clear recent final natural public whole major open easy short human special free small
large young old good new first last long great little own other right big high different
""".split()

SEP = "\n"


@dataclass(frozen=True)
class Turn:
    """One request of a session: the text it adds to the conversation, and its budget."""

    message: str
    max_tokens: int


@dataclass(frozen=True)
class Session:
    """One conversation. `after` names a group: the session starts once every session of
    that group has received its first token (plus `delay` seconds), which is how a
    workload makes prompts arrive while other requests are decoding."""

    turns: tuple[Turn, ...]
    group: str = "main"
    after: str | None = None
    delay: float = 0.0


class TextMaker:
    """Random text of a given length in tokens: exact with a tokenizer, ~1 token/word without."""

    def __init__(self, rng: random.Random, tokenizer: Any | None = None) -> None:
        self.rng = rng
        self.tok: Any = tokenizer  # a transformers tokenizer, or None

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(max(n, 1)))

    def text(self, n_tokens: int) -> str:
        if self.tok is None:
            return self.words(n_tokens)
        ids: list[int] = []
        n_words = n_tokens
        while len(ids) < n_tokens:  # tokens per word vary by tokenizer: draw until enough
            ids = self._encode(self.words(n_words))
            n_words *= 2
        return self._fit(ids, n_tokens)

    def count(self, text: str) -> int:
        return len(self._encode(text)) if self.tok is not None else len(text.split())

    def _encode(self, text: str) -> list[int]:
        # verbose=False: drafts longer than the model's limit are fine here, no warning
        return self.tok.encode(text, add_special_tokens=False, verbose=False)

    def _fit(self, ids: list[int], n: int) -> str:
        """Decodes ids[:n]; re-encoding can merge across the cut, so nudge the cut a little."""
        best, best_err = "", None
        for cut in (n, n + 1, n - 1, n + 2, n - 2):
            text = self.tok.decode(ids[: max(cut, 1)])
            err = abs(len(self._encode(text)) - n)
            if best_err is None or err < best_err:
                best, best_err = text, err
            if err == 0:
                break
        return best


# ---- the workloads ------------------------------------------------------------------


def single(message: str, max_tokens: int, group: str = "main") -> Session:
    return Session((Turn(message, max_tokens),), group)


def shared_prefix(ns: argparse.Namespace, mk: TextMaker) -> list[Session]:
    """One long prefix, a distinct short tail per request: what a prefix cache is for."""
    prefix = mk.text(ns.prefix_len)
    return [
        single(prefix + SEP + mk.text(ns.input_len), ns.output_len) for _ in range(ns.num_prompts)
    ]


def distinct(ns: argparse.Namespace, mk: TextMaker) -> list[Session]:
    """Prompts of one length that share nothing: cold prefill."""
    return [single(mk.text(ns.input_len), ns.output_len) for _ in range(ns.num_prompts)]


def multi_turn(ns: argparse.Namespace, mk: TextMaker) -> list[Session]:
    """Conversations: every turn resends the whole history plus a new message; with
    --system-prompt-len, all of them open with the same system prompt."""
    system = mk.text(ns.system_prompt_len) + SEP if getattr(ns, "system_prompt_len", 0) else ""

    def conversation() -> Session:
        turns = [Turn(mk.text(ns.input_len), ns.output_len) for _ in range(ns.num_turns)]
        if turns:
            turns[0] = Turn(system + turns[0].message, ns.output_len)
        return Session(tuple(turns))

    return [conversation() for _ in range(ns.num_prompts)]


def generated_shared_prefix(ns: argparse.Namespace, mk: TextMaker) -> list[Session]:
    """SGLang's generated-shared-prefix: groups of questions behind one system prompt each,
    group after group (--gsp-interleave: question 1 of every group, then question 2, ..., so
    each system prompt must outlive all the others' to be reused)."""
    groups = []
    for _ in range(ns.gsp_num_groups):
        system = mk.text(ns.gsp_system_prompt_len)
        groups.append(
            [
                single(system + SEP + mk.text(ns.gsp_question_len), ns.gsp_output_len)
                for _ in range(ns.gsp_prompts_per_group)
            ]
        )
    if getattr(ns, "gsp_interleave", False):
        return [g[i] for i in range(ns.gsp_prompts_per_group) for g in groups]
    return [s for g in groups for s in g]


def random_lengths(ns: argparse.Namespace, mk: TextMaker) -> list[Session]:
    """Lengths uniform in [max(1, L * range_ratio), L] (SGLang's convention)."""

    def length(full: int) -> int:
        return mk.rng.randint(max(1, int(full * ns.range_ratio)), max(full, 1))

    return [
        single(mk.text(length(ns.input_len)), length(ns.output_len)) for _ in range(ns.num_prompts)
    ]


def prefill_stall(ns: argparse.Namespace, mk: TextMaker) -> list[Session]:
    """`num_prompts` streams decode ("decode" group); once each has its first token (plus
    `stall_delay` s), `stall_prompts` long prompts arrive ("prefill" group). The decode
    group's inter-token latency shows how long prefill stalls decoding."""
    decode = [single(mk.text(ns.input_len), ns.output_len, "decode") for _ in range(ns.num_prompts)]
    prefill = [
        Session(
            (Turn(mk.text(ns.stall_input_len), ns.stall_output_len),),
            "prefill",
            "decode",
            ns.stall_delay,
        )
        for _ in range(ns.stall_prompts)
    ]
    return decode + prefill


WORKLOADS: dict[str, Callable[[argparse.Namespace, TextMaker], list[Session]]] = {
    "shared-prefix": shared_prefix,
    "distinct": distinct,
    "multi-turn": multi_turn,
    "generated-shared-prefix": generated_shared_prefix,
    "random": random_lengths,
    "prefill-stall": prefill_stall,
}


def build(ns: argparse.Namespace, tokenizer: Any | None = None) -> list[Session]:
    """The sessions of `ns.workload`, from `ns.seed`; `--shuffle` mixes their order."""
    mk = TextMaker(random.Random(ns.seed), tokenizer)
    sessions = WORKLOADS[ns.workload](ns, mk)
    if ns.shuffle:
        random.Random(ns.seed + 1).shuffle(sessions)
    return sessions
