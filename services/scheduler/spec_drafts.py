"""Draft tokens for speculative decoding without a draft model (docs/speculative.md).

Pure bookkeeping, no tensors: ``ngram_draft`` (prompt lookup in the request's own tokens),
``DraftIndex`` (SuffixDecoding's suffix trie over every sequence of a namespace),
``AdaptiveLength`` (per-request speculation length) and ``propose`` (the scheduler's call).
"""

from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from operator import attrgetter
from typing import NamedTuple

from services.scheduler.tokens import TYPECODE, Tokens, as_tokens

__all__ = [
    "ALGORITHMS",
    "AdaptiveLength",
    "Draft",
    "DraftIndex",
    "DraftIndexError",
    "ngram_draft",
    "propose",
]

ALGORITHMS = ("none", "ngram", "suffix")  # the CLI's choices come from here
_ITEM = array(TYPECODE).itemsize


def ngram_draft(tokens: Sequence[int], k: int, min_n: int = 2, max_n: int = 4) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest
    suffix of `tokens` (max_n down to min_n tokens)."""
    toks = as_tokens(tokens)
    n_all = len(toks)
    if k <= 0 or n_all < 2:
        return []
    # rfind runs in C; a hit off an item boundary straddles two tokens and is skipped.
    hay = toks.tobytes()
    end = (n_all - 1) * _ITEM  # an occurrence must end before the last token: something follows
    for n in range(min(max_n, n_all - 1), max(min_n, 1) - 1, -1):
        pat = hay[(n_all - n) * _ITEM :]
        at = hay.rfind(pat, 0, end)
        while at > 0 and at % _ITEM:
            at = hay.rfind(pat, 0, at + len(pat) - 1)
        if at >= 0:
            start = at // _ITEM + n
            return toks[start : start + k].tolist()
    return []


class DraftIndexError(RuntimeError):
    """The draft index disagrees with itself (counts, structure, references)."""


class _Run:
    """Token storage a node can point into: `tokens[i]` is the token at position base + i."""

    __slots__ = ("tokens", "base")

    def __init__(self, tokens: Tokens, base: int = 0) -> None:
        self.tokens = tokens
        self.base = base


class _Seq(_Run):
    """A held sequence; `ends[i]` is the node where the window starting at base + i ends."""

    __slots__ = ("ns", "sid", "ends", "first")

    def __init__(self, ns: str, sid: str) -> None:
        super().__init__(as_tokens(()))
        self.ns = ns
        self.sid = sid
        self.ends: list[_Node] = []
        self.first = 0

    @property
    def live(self) -> int:
        return len(self.tokens) - self.first


class _Node:
    """A node of the path-compressed trie; its path is a slice of one window through it
    (``src``, ``at``), so edge labels cost no memory. `count`: windows through or ending on
    the edge (a node is kept wherever a window ends); `ends`: those ending here; `best`:
    the child with the highest (count, stamp), None when unknown."""

    __slots__ = ("parent", "children", "count", "ends", "depth", "src", "at", "stamp", "best")

    def __init__(self, parent: _Node | None, depth: int, src: _Run, at: int, stamp: int) -> None:
        self.parent = parent
        self.children: dict[int, _Node] | None = None
        self.count = 0
        self.ends = 0
        self.depth = depth
        self.src = src
        self.at = at
        self.stamp = stamp
        self.best: _Node | None = None

    def token(self, d: int) -> int:
        return self.src.tokens[self.at - self.src.base + d]

    def path(self, a: int, b: int) -> Tokens:
        o = self.at - self.src.base
        return self.src.tokens[o + a : o + b]


_rank = attrgetter("count", "stamp")


def _best(node: _Node) -> _Node | None:
    """The most frequent child, ties to the most recently entered (cached)."""
    if node.best is None and node.children:
        node.best = max(node.children.values(), key=_rank)
    return node.best


class Draft(NamedTuple):
    tokens: list[int]
    match_len: int  # length of the context's suffix the draft continues (0: no match)
    prob: float  # estimated probability that every drafted token is accepted


def _no_draft() -> Draft:
    return Draft([], 0, 0.0)


class DraftIndex:
    """A suffix index over finished and running sequences, one trie per namespace (a draft
    never crosses namespaces), holding at most max_tokens (LRU sequences evicted first).
    Each sequence inserts its windows ``tokens[i : i + max_depth]``, counted per node."""

    def __init__(
        self, max_tokens: int = 1 << 20, max_depth: int = 32, min_prob: float = 0.1
    ) -> None:
        if max_tokens < 1 or max_depth < 2:
            raise ValueError("max_tokens must be >= 1 and max_depth >= 2")
        self.max_tokens = max_tokens
        self.max_depth = max_depth
        self.min_prob = min_prob
        self._seqs: OrderedDict[str, _Seq] = OrderedDict()  # least recently used first
        self._roots: dict[str, _Node] = {}
        self._num_tokens = 0
        self._num_nodes = 0
        self._clock = 0

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def __len__(self) -> int:
        return len(self._seqs)

    def sequences(self) -> Iterator[tuple[str, str, list[int]]]:
        """(namespace, seq_id, tokens held) per sequence, least recently used first."""
        for s in self._seqs.values():
            yield s.ns, s.sid, s.tokens[s.first :].tolist()

    # -- updates -----------------------------------------------------------------------

    def add(self, namespace: str, seq_id: str, tokens: Sequence[int]) -> None:
        """Register `seq_id` (replacing what it held) with its last max_tokens tokens."""
        if seq_id in self._seqs:
            self.remove(seq_id)
        toks = as_tokens(tokens)[-self.max_tokens :]
        self._make_room(len(toks), None)
        seq = self._seqs[seq_id] = _Seq(namespace, seq_id)
        self._grow(seq, toks)

    def extend(self, namespace: str, seq_id: str, new_tokens: Sequence[int]) -> None:
        """Inserts only the windows the new tokens touch; an unknown seq_id is added."""
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.ns != namespace:
            raise ValueError(f"sequence {seq_id!r} is held in namespace {seq.ns!r}")
        new = as_tokens(new_tokens)
        if seq is None or len(new) >= self.max_tokens:
            self.add(namespace, seq_id, new)
            return
        self._seqs.move_to_end(seq_id)
        self._make_room(len(new), seq)
        self._grow(seq, new)
        while self._num_tokens > self.max_tokens:  # only seq is left: drop its oldest windows
            self._drop_front(seq)

    def remove(self, seq_id: str) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        for i in range(len(seq.tokens) - 1, seq.first - 1, -1):
            self._remove_window(seq, i)
        root = self._roots.get(seq.ns)
        if root is not None and root.count == 0:
            del self._roots[seq.ns]
            self._num_nodes -= 1

    def _make_room(self, n: int, keep: _Seq | None) -> None:
        """Evict least recently used sequences (never `keep`) until n more tokens fit."""
        while self._num_tokens + n > self.max_tokens and self._seqs:
            oldest = next(iter(self._seqs.values()))
            if oldest is keep:
                return
            self.remove(oldest.sid)

    def _root(self, ns: str) -> _Node:
        root = self._roots.get(ns)
        if root is None:
            root = self._roots[ns] = _Node(None, 0, _Run(as_tokens(())), 0, 0)
            self._num_nodes += 1
        return root

    # A new token opens a window at the root and extends each active window (the last
    # max_depth, still short of full length) by one step from its end node.

    def _grow(self, seq: _Seq, new: Tokens) -> None:
        if not new:
            return
        root = self._root(seq.ns)
        d_max, base = self.max_depth, seq.base
        tokens, ends = seq.tokens, seq.ends
        for t in new:
            tokens.append(t)
            ends.append(root)
            root.count += 1
            root.ends += 1
            lo = max(seq.first, len(tokens) - d_max)
            for j, node in enumerate(ends[lo:]):
                if node.count == 1 and not node.children and node.parent is not None:
                    node.depth += 1  # a leaf of this window alone: its edge just grows
                    if node.src is not seq:  # (a copied path: see _repoint)
                        node.src, node.at = seq, base + lo + j
                else:
                    i = lo + j
                    ends[i] = self._step(seq, base + i, node, t, len(tokens) - i)
        self._num_tokens += len(new)

    def _step(self, seq: _Seq, pos: int, node: _Node, t: int, depth: int) -> _Node:
        """Moves the window starting at `pos` on by token t; returns its new end node."""
        kids = node.children
        if node.ends == 1 and kids and len(kids) == 1 and node.parent is not None:
            child = kids.get(t)
            if child is not None and child.depth > depth:
                # Alone here with one way on: slide node down the edge (split + merge).
                node.depth = depth
                node.src, node.at = seq, pos
                node.children = {child.token(depth): child}
                return node
        node.ends -= 1
        self._clock += 1
        if node.children is None:
            node.children = {}
        child = node.children.get(t)
        if child is None:
            child = node.children[t] = _Node(node, depth, seq, pos, self._clock)
            self._num_nodes += 1
        elif child.depth > depth:
            child = self._split(node, child, depth)
        child.count += 1
        child.ends += 1
        child.src, child.at, child.stamp = seq, pos, self._clock
        best = node.best
        if (
            best is None
            and len(node.children) == 1
            or best is not None
            and child.count >= best.count
        ):
            node.best = child
        if node.ends == 0 and len(node.children) == 1 and node.parent is not None:
            self._merge(node)
        return child

    def _split(self, parent: _Node, child: _Node, depth: int) -> _Node:
        """A node at `depth` on the edge into `child`; returns it."""
        mid = _Node(parent, depth, child.src, child.at, child.stamp)
        mid.count = child.count
        mid.children = {child.token(depth): child}
        mid.best = child
        assert parent.children is not None
        parent.children[child.token(parent.depth)] = mid
        if parent.best is child:
            parent.best = mid
        child.parent = mid
        self._num_nodes += 1
        return mid

    def _merge(self, node: _Node) -> None:
        """Fold `node` (no window ends there, one child) into its child."""
        parent = node.parent
        assert parent is not None and parent.children is not None and node.children
        (child,) = node.children.values()
        child.parent = parent
        child.stamp = node.stamp  # the merged edge is entered where node's was
        parent.children[node.token(parent.depth)] = child
        if parent.best is node:
            parent.best = child
        node.parent = node.children = node.best = None
        self._num_nodes -= 1

    def _drop_front(self, seq: _Seq) -> None:
        """Forgets seq's oldest window; compacts its arrays once half of them is dead."""
        self._remove_window(seq, seq.first)
        seq.first += 1
        if seq.first >= 64 and 2 * seq.first >= len(seq.tokens):
            del seq.tokens[: seq.first]
            del seq.ends[: seq.first]
            seq.base += seq.first
            seq.first = 0

    def _remove_window(self, seq: _Seq, i: int) -> None:
        """Takes the window at index i of seq out of the trie, bottom-up from its end."""
        pos = seq.base + i
        node = seq.ends[i]
        node.ends -= 1
        survivor: _Node | None = None
        while node.parent is not None:
            parent = node.parent
            node.count -= 1
            if parent.best is node:
                parent.best = None
            if node.count == 0:
                assert parent.children is not None
                del parent.children[node.token(parent.depth)]
                node.parent = None
                self._num_nodes -= 1
            else:
                if survivor is None:
                    survivor = node
                if node.src is seq and node.at == pos:
                    self._repoint(node)
            node = parent
        node.count -= 1
        self._num_tokens -= 1
        if (
            survivor is not None
            and survivor.ends == 0
            and survivor.children
            and len(survivor.children) == 1
        ):
            self._merge(survivor)

    def _repoint(self, node: _Node) -> None:
        """node's reference window is going: borrow a child's, or copy a leaf's path."""
        if node.children:
            child = next(iter(node.children.values()))
            node.src, node.at = child.src, child.at
        else:
            node.src, node.at = _Run(node.path(0, node.depth)), 0

    # -- proposals ---------------------------------------------------------------------

    def propose(
        self, namespace: str, context: Sequence[int], k: int, exclude: str | None = None
    ) -> list[int]:
        return self.draft(namespace, context, k, exclude).tokens

    def draft(
        self, namespace: str, context: Sequence[int], k: int, exclude: str | None = None
    ) -> Draft:
        """Up to k tokens likely to follow `context`: the most frequent continuation of its
        longest matched suffix (at most max_depth - k), while the joint probability stays
        >= min_prob. Windows cut off by max_depth or their sequence's end do not count
        against a token. `exclude`: a seq_id left out of every count."""
        root = self._roots.get(namespace)
        if root is None or k <= 0 or not context:
            return _no_draft()
        skip = self._seqs.get(exclude) if exclude is not None else None
        if skip is not None and skip.ns != namespace:
            skip = None
        ctx = as_tokens(context[-self.max_depth :])
        match = self._match(root, ctx, min(len(ctx), max(1, self.max_depth - k)), skip)
        if match is None:
            return _no_draft()
        node, depth, occ = match
        tokens, prob = self._walk(node, depth, occ, k, skip)
        return Draft(tokens, depth, prob) if tokens else _no_draft()

    def _match(
        self, root: _Node, ctx: Tokens, longest: int, skip: _Seq | None
    ) -> tuple[_Node, int, list[int]] | None:
        """The longest d <= longest whose context[-d:] a counted window continues; binary
        search, as the matching lengths form a range from 1."""
        lo, hi, found = 0, longest, None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            probe = self._probe(root, ctx[len(ctx) - mid :], skip)
            if probe is None:
                hi = mid - 1
            else:
                lo, found = mid, probe
        return None if found is None else (found[0], lo, found[1])

    def _probe(self, root: _Node, pat: Tokens, skip: _Seq | None) -> tuple[_Node, list[int]] | None:
        """(node holding pat's end, skip's windows continuing pat), or None."""
        node = _locate(root, pat)
        if node is None:
            return None
        d = len(pat)
        occ = _continuing(skip, pat, self.max_depth) if skip is not None else []
        going_on = node.count if d < node.depth else node.count - node.ends
        return (node, occ) if going_on > len(occ) else None

    def _walk(
        self, node: _Node, d: int, occ: list[int], k: int, skip: _Seq | None
    ) -> tuple[list[int], float]:
        out: list[int] = []
        prob = 1.0
        while len(out) < k:
            if d < node.depth:  # inside an edge: one way on, which every window there takes
                t, nxt, p = node.token(d), node, 1.0
            else:
                step = _pick(node, d, occ, skip)
                if step is None:
                    break
                t, nxt, p = step
            if prob * p < self.min_prob:
                break
            prob *= p
            out.append(t)
            node, d = nxt, d + 1
            if occ:
                occ = _advance(skip, occ, d, t, self.max_depth)
        return out, prob

    # -- checks (tests, debugging: they walk everything) --------------------------------

    def path_counts(self) -> dict[tuple[str, tuple[int, ...]], int]:
        """{(namespace, path): windows with that prefix}: the uncompressed trie's counts."""
        out: dict[tuple[str, tuple[int, ...]], int] = {}
        for ns, node in _walk_nodes(self._roots):
            if node.parent is None:
                continue
            full = tuple(node.path(0, node.depth))
            for d in range(node.parent.depth + 1, node.depth + 1):
                out[ns, full[:d]] = node.count
        return out

    def check_integrity(self) -> None:
        """Raises DraftIndexError on the first disagreement of a full recount."""
        nodes = 0
        for ns, node in _walk_nodes(self._roots):
            nodes += 1
            self._check_node(ns, node)
        _expect(nodes == self._num_nodes, f"{nodes} nodes, counter says {self._num_nodes}")
        total = sum(s.live for s in self._seqs.values())
        _expect(total == self._num_tokens, f"{total} windows, counter {self._num_tokens}")
        _expect(total <= self.max_tokens, f"{total} tokens held > max_tokens")
        for seq in self._seqs.values():
            self._check_seq(seq)
        for ns, root in self._roots.items():
            held = sum(s.live for s in self._seqs.values() if s.ns == ns)
            _expect(root.count == held, f"root {ns!r} counts {root.count}, holds {held}")

    def _check_node(self, ns: str, node: _Node) -> None:
        kids = list(node.children.values()) if node.children else []
        below = sum(c.count for c in kids)
        _expect(node.count == node.ends + below, f"{node.count} != {node.ends} + {below}")
        _expect(node.count > 0, "an empty node")
        for key, c in (node.children or {}).items():
            _expect(c.parent is node and c.depth > node.depth, "bad child link")
            _expect(c.token(node.depth) == key, "child filed under the wrong token")
            _expect(c.path(0, node.depth) == node.path(0, node.depth), "paths disagree")
        if node.best is not None:
            _expect(node.best in kids and _rank(node.best) == max(map(_rank, kids)), "best")
        if node.parent is None:
            _expect(node.ends == 0 and node.depth == 0, "a root that is not one")
            return
        _expect(node.ends > 0 or len(kids) != 1, "a node that should be merged")
        src = node.src
        if isinstance(src, _Seq):
            i = node.at - src.base
            _expect(self._seqs.get(src.sid) is src and src.ns == ns, "refers to a dead sequence")
            window = min(self.max_depth, len(src.tokens) - i)
            _expect(src.first <= i and window >= node.depth, "refers to a dead window")
        else:
            _expect(node.at == 0 and len(src.tokens) >= node.depth, "a copied path")

    def _check_seq(self, seq: _Seq) -> None:
        n = len(seq.tokens)
        _expect(len(seq.ends) == n, "one end node per window")
        for i in range(seq.first, n):
            end = seq.ends[i]
            want = seq.tokens[i : i + self.max_depth]
            _expect(end.depth == len(want) and end.path(0, end.depth) == want, "window end")
            while end.parent is not None:
                end = end.parent
            _expect(end is self._roots.get(seq.ns), "window end outside its namespace's trie")


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise DraftIndexError(what)


def _walk_nodes(roots: dict[str, _Node]) -> Iterator[tuple[str, _Node]]:
    for ns, root in roots.items():
        stack = [root]
        while stack:
            node = stack.pop()
            yield ns, node
            if node.children:
                stack.extend(node.children.values())


def _locate(root: _Node, pat: Tokens) -> _Node | None:
    """The node whose edge holds the end of `pat` (root when empty), or None."""
    node, d, n = root, 0, len(pat)
    while d < n:
        child = node.children.get(pat[d]) if node.children else None
        if child is None:
            return None
        e = min(child.depth, n)
        if e > d + 1 and child.path(d + 1, e) != pat[d + 1 : e]:
            return None
        node, d = child, e
    return node


def _continuing(seq: _Seq, pat: Tokens, max_depth: int) -> list[int]:
    """Indices (into seq's arrays) of seq's windows that hold `pat` and go on past it."""
    d = len(pat)
    n = len(seq.tokens)
    if d >= max_depth:
        return []
    hay, needle = seq.tokens.tobytes(), pat.tobytes()
    out: list[int] = []
    at = hay.find(needle, seq.first * _ITEM, (n - 1) * _ITEM)  # the last token continues nothing
    while at >= 0:
        if at % _ITEM == 0:
            out.append(at // _ITEM)
        at = hay.find(needle, at + 1, (n - 1) * _ITEM)
    return out


def _advance(seq: _Seq | None, occ: list[int], d: int, t: int, max_depth: int) -> list[int]:
    """The windows of occ whose token at depth d-1 is t and that go on past depth d."""
    if seq is None or d >= max_depth:
        return []
    toks, n = seq.tokens, len(seq.tokens)
    return [i for i in occ if toks[i + d - 1] == t and i + d < n]


def _pick(
    node: _Node, d: int, occ: list[int], skip: _Seq | None
) -> tuple[int, _Node, float] | None:
    going_on = node.count - node.ends - len(occ)
    if going_on <= 0 or not node.children:
        return None
    if not occ or skip is None:
        best = _best(node)
        assert best is not None
        return best.token(d), best, best.count / going_on
    theirs = Counter(skip.tokens[i + d] for i in occ)
    key, child = max(
        node.children.items(), key=lambda kv: (kv[1].count - theirs[kv[0]], kv[1].stamp)
    )
    return key, child, (child.count - theirs[key]) / going_on


class AdaptiveLength:
    """Per-request speculation length from its acceptance history (the rule:
    docs/speculative.md). It goes off below `min_rate` because a verify step costs more
    than a plain one; while off it probes, ever more rarely. `start_off`: begin probing."""

    def __init__(
        self,
        max_k: int,
        probe_every: int = 16,
        min_rate: float = 0.3,
        max_probe_every: int = 512,
        start_off: bool = False,
    ) -> None:
        if max_k < 0 or probe_every < 1 or max_probe_every < probe_every:
            raise ValueError("max_k must be >= 0 and 1 <= probe_every <= max_probe_every")
        self.max_k, self.min_rate = max_k, min_rate
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self._k = 0 if start_off else max_k
        self._rate = 1.0  # moving share of drafted tokens accepted
        self._wait = probe_every  # steps between probes while off
        self._idle = 0  # steps since speculation went off or last probed

    @property
    def k(self) -> int:
        """0: off, probing."""
        return self._k

    def next_k(self) -> int:
        if self._k > 0 or self.max_k == 0:
            return self._k
        self._idle += 1
        if self._idle < self._wait:
            return 0
        self._idle = 0
        return 1

    def observe(self, drafted: int, accepted: int) -> None:
        """The verifier accepted `accepted` of the `drafted` tokens (bonus token not counted)."""
        if drafted <= 0:
            return
        if self._k == 0:  # a probe
            if accepted:
                self._k, self._rate, self._wait = min(2, self.max_k), 1.0, self.probe_every
            else:
                self._wait = min(2 * self._wait, self.max_probe_every)
            return
        self._rate = 0.7 * self._rate + 0.3 * accepted / drafted
        if accepted >= drafted:
            self._k = min(self.max_k, max(self._k, drafted) + 1)
        elif accepted == 0:
            self._k //= 2
        # Partly accepted: the draft held until one divergence, which says nothing of where
        # the next draft's will come, so k stays (shrinking to it cost tokens: benchmarks.md).
        if self._rate < self.min_rate:
            self._k = 0


def propose(
    algorithm: str,
    index: DraftIndex | None,
    namespace: str,
    seq_id: str,
    tokens: Sequence[int],
    k: int,
    exclude_own: bool = False,
) -> list[int]:
    """'ngram': ngram_draft of the request's own tokens; 'suffix': that, else the index if
    it drafts more; 'none': []. The request's own windows stay in the index's counts (its
    repeats are evidence too, and leaving them out costs a scan) unless `exclude_own`."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown draft algorithm {algorithm!r}; choose from {ALGORITHMS}")
    if algorithm == "none" or k <= 0:
        return []
    own = ngram_draft(tokens, k)
    if algorithm == "ngram" or index is None or len(own) >= k:
        return own
    held = index.propose(namespace, tokens, k, exclude=seq_id if exclude_own else None)
    return held if len(held) > len(own) else own
