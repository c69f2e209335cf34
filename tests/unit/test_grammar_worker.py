"""Constrained decoding in the worker: compile statuses over the wire, masking, matcher
advance, termination, replay after a retraction, and the compile cache."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
from transformers import AutoTokenizer

from radixserve.internal.v1 import engine_pb2
from services.common.config import DEFAULT_MODEL_PATH, WorkerConfig
from services.common.transport import pack_i32
from services.worker import wire
from services.worker.batch import Constraint
from services.worker.grammar.compiler import compiler_message
from services.worker.model_runner import ModelRunner

PROMPT_TEXT = "The answer is"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_PATH)


@pytest.fixture(scope="module")
def runner():
    return _runner()


def _runner(**kw) -> ModelRunner:
    cfg = dict(
        model_path=DEFAULT_MODEL_PATH, device="cpu", max_total_tokens=2048, max_running_requests=4
    )
    cfg.update(kw)
    return ModelRunner(WorkerConfig(**cfg))


class Driver:
    """Drives one runner through the wire like a scheduler would (no overlap)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.batch_id = 0
        self.next_slot = 1

    def send(self, reqs=(), grammars=()) -> engine_pb2.ForwardResult:
        self.batch_id += 1
        msg = engine_pb2.ForwardBatch(
            batch_id=self.batch_id, reqs=list(reqs), grammars=list(grammars)
        )
        msg.is_decode = bool(reqs) and all(len(r.input_ids) == 4 for r in reqs)
        return wire.forward(self.runner, msg)

    def compile(self, rid: str, constraint: engine_pb2.Constraint, wait_s: float = 30.0):
        statuses = list(
            self.send(grammars=[engine_pb2.GrammarCompile(rid=rid, constraint=constraint)]).grammars
        )
        deadline = time.monotonic() + wait_s
        while not statuses and time.monotonic() < deadline:
            statuses = list(self.send().grammars)
        assert len(statuses) == 1 and statuses[0].rid == rid
        return statuses[0]

    def alloc(self, n: int) -> list[int]:
        slots = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        return slots

    def generate(
        self, prompt: list[int], sampling: engine_pb2.SamplingParams, max_tokens: int, slot: int = 0
    ):
        """(tokens, finished_by_grammar, error)."""
        out: list[int] = []
        slots = self.alloc(len(prompt))
        req = engine_pb2.ForwardRequest(
            req_slot=slot,
            input_ids=pack_i32(prompt),
            prefix_len=0,
            out_slots=pack_i32(slots),
            is_new=True,
            sample=True,
            sampling=sampling,
        )
        pos = len(prompt)
        for _ in range(max_tokens):
            tok = self.send([req]).tokens[0]
            if tok.grammar_error:
                return out, False, tok.grammar_error
            out.append(tok.token_id)
            if tok.grammar_terminated or tok.token_id in self.runner.eos_token_ids:
                return out, tok.grammar_terminated, ""
            req = engine_pb2.ForwardRequest(
                req_slot=slot,
                input_ids=pack_i32([tok.token_id]),
                prefix_len=pos,
                out_slots=pack_i32(self.alloc(1)),
                sample=True,
            )
            pos += 1
        return out, False, ""


def _text(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _tag(fmt: dict) -> str:
    return json.dumps({"type": "structural_tag", "format": fmt})


def test_regex_output_matches_and_terminates(runner, tokenizer):
    d = Driver(runner)
    c = engine_pb2.Constraint(regex=r"[A-Z]{2}-\d{3}")
    assert d.compile("r1", c).error == ""
    prompt = tokenizer.encode(PROMPT_TEXT)
    for seed in range(3):
        sp = engine_pb2.SamplingParams(temperature=1.0, seed=seed, constraint=c)
        ids, by_grammar, err = d.generate(prompt, sp, 32)
        assert err == ""
        assert re.fullmatch(r"[A-Z]{2}-\d{3}", _text(tokenizer, ids)), _text(tokenizer, ids)


def test_json_schema_output_validates(runner, tokenizer):
    d = Driver(runner)
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"},
            "tag": {"enum": ["a", "b", "c"]},
        },
        "required": ["n", "ok", "tag"],
    }
    c = engine_pb2.Constraint(json_schema=json.dumps(schema))
    assert d.compile("j1", c).error == ""
    prompt = tokenizer.encode(PROMPT_TEXT)
    for seed in range(3):
        sp = engine_pb2.SamplingParams(temperature=1.0, seed=seed, constraint=c)
        ids, _, err = d.generate(prompt, sp, 64)
        assert err == ""
        jsonschema.validate(json.loads(_text(tokenizer, ids)), schema)


def test_structural_tag_output_is_a_call_with_valid_arguments(runner, tokenizer):
    """Calls only (at least one, no text around them): each is begin, arguments valid against
    the schema, end."""
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    }
    content = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    call = {"type": "tag", "begin": "<f>", "content": content, "end": "</f>"}
    fmt = {"type": "tags_with_separator", "tags": [call], "separator": ";", "at_least_one": True}
    c = engine_pb2.Constraint(structural_tag=_tag(fmt))
    assert Driver(runner).compile("st", c).error == ""
    prompt = tokenizer.encode(PROMPT_TEXT)
    for seed in range(3):
        sp = engine_pb2.SamplingParams(temperature=1.0, seed=seed, constraint=c)
        ids, _, err = Driver(runner).generate(prompt, sp, 160)
        text = _text(tokenizer, ids)
        assert err == "" and re.fullmatch(r"<f>(.*?)</f>(;<f>(.*?)</f>)*", text, re.S), text
        for args in re.findall(r"<f>(.*?)</f>", text, re.S):
            jsonschema.validate(json.loads(args), schema)


def test_structural_tag_in_the_older_form_and_json_safe_strings(runner):
    """vLLM's / SGLang's {"structures", "triggers"} compiles as triggered tags; strings with
    maxLength inside refuse control characters, as in json_schema."""
    import xgrammar as xgr

    legacy = {
        "structures": [
            {"begin": "<f>", "schema": {"type": "string", "maxLength": 4}, "end": "</f>"}
        ],
        "triggers": ["<f"],
    }
    compiled = (
        runner.grammars.build()
        .compiler.submit(Constraint("structural_tag", json.dumps(legacy)))
        .result(30)
    )
    ok, bad = xgr.GrammarMatcher(compiled), xgr.GrammarMatcher(compiled)
    assert ok.accept_string('text <f>"ab"</f> more')
    assert not bad.accept_string('<f>"a\x01')


@pytest.mark.parametrize(
    ("constraint", "needle"),
    [
        (engine_pb2.Constraint(regex="[a-"), "Unclosed"),
        (engine_pb2.Constraint(regex="a(?=b)"), "Lookahead"),
        (engine_pb2.Constraint(ebnf='root ::= "a'), "string literal"),
        (engine_pb2.Constraint(ebnf='start ::= "a"'), "root"),
        (engine_pb2.Constraint(json_schema="{bad"), "not valid JSON"),
        (engine_pb2.Constraint(json_schema='{"type": "objec"}'), "objec"),
        (engine_pb2.Constraint(json_schema='{"not": {"type": "string"}}'), "'not'"),
        (engine_pb2.Constraint(json_schema='{"$ref": "#/$defs/missing"}'), "missing"),
        (engine_pb2.Constraint(structural_tag="{bad"), "not valid JSON"),
        (engine_pb2.Constraint(structural_tag=_tag({"type": "nope"})), "nope"),
        (engine_pb2.Constraint(structural_tag=_tag({"type": "or", "elements": []})), "element"),
        (
            engine_pb2.Constraint(
                structural_tag=_tag({"type": "json_schema", "json_schema": {"not": {}}})
            ),
            "format.json_schema: keyword 'not'",
        ),
        (engine_pb2.Constraint(structural_tag='{"structures": []}'), "structures must be"),
    ],
)
def test_refused_constraints_name_the_problem(runner, constraint, needle):
    st = Driver(runner).compile("bad", constraint)
    assert st.error_code == "INVALID_ARGUMENT"
    assert needle in st.error
    assert not st.error.startswith("[")  # xgrammar's file:line prefix is stripped


def test_compile_cache_hits_and_timeout_not_cached_as_invalid():
    r = _runner(grammar_compile_timeout=0.0, grammar_cache_size=2)
    d = Driver(r)
    c = engine_pb2.Constraint(regex=r"x\d+y")
    st = d.compile("t1", c)  # timeout 0: past the deadline before the compile ends
    assert st.error_code == "DEADLINE_EXCEEDED" and "grammar-compile-timeout" in st.error
    r.grammars.compiler.submit(Constraint("regex", r"x\d+y")).result(30)  # it went on
    misses = r.grammars.compiler.misses
    assert d.compile("t2", c).error == ""  # now ready at once, from the cache
    assert r.grammars.compiler.misses == misses and r.grammars.compiler.hits >= 2
    for text in ("a", "b", "c"):  # LRU of 2: the first goes
        r.grammars.compiler.submit(Constraint("regex", text)).result(30)
    assert not r.grammars.compiler.cached(Constraint("regex", r"x\d+y"))


def test_replay_after_retraction_restores_the_matcher(runner, tokenizer):
    """A slot restarted with its output so far masks exactly as the uninterrupted one."""
    d = Driver(runner)
    schema = {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 6}},
        "required": ["word"],
    }
    c = engine_pb2.Constraint(json_schema=json.dumps(schema))
    assert d.compile("rp", c).error == ""
    prompt = tokenizer.encode(PROMPT_TEXT)
    sp = engine_pb2.SamplingParams(temperature=1.0, seed=7, constraint=c)
    full, _, _ = d.generate(prompt, sp, 64, slot=0)
    cut = len(full) // 2
    # Resume on another slot: the prompt + first half recomputed, output_ids replayed.
    d2 = Driver(runner)
    d2.next_slot = 1000
    ids = prompt + full[:cut]
    req = engine_pb2.ForwardRequest(
        req_slot=1,
        input_ids=pack_i32(ids),
        prefix_len=0,
        out_slots=pack_i32(d2.alloc(len(ids))),
        is_new=True,
        sample=True,
        sampling=sp,
        output_ids=pack_i32(full[:cut]),
    )
    rest = []
    pos = len(ids)
    for _ in range(64):
        tok = d2.send([req]).tokens[0]
        assert tok.grammar_error == ""
        rest.append(tok.token_id)
        if tok.grammar_terminated or tok.token_id in runner.eos_token_ids:
            break
        req = engine_pb2.ForwardRequest(
            req_slot=1,
            input_ids=pack_i32([tok.token_id]),
            prefix_len=pos,
            out_slots=pack_i32(d2.alloc(1)),
            sample=True,
        )
        pos += 1
    assert full[:cut] + rest == full


def test_rejected_token_is_reported_for_that_row_only(runner, tokenizer):
    """A replay the grammar refuses marks that request's rows; its batch mate is untouched."""
    d = Driver(runner)
    c = engine_pb2.Constraint(regex=r"\d+")
    assert d.compile("rj", c).error == ""
    bad = tokenizer.encode("abc")
    prompt = tokenizer.encode(PROMPT_TEXT)
    slots_a, slots_b = d.alloc(len(prompt)), d.alloc(len(prompt))
    reqs = [
        engine_pb2.ForwardRequest(
            req_slot=0,
            input_ids=pack_i32(prompt),
            out_slots=pack_i32(slots_a),
            is_new=True,
            sample=True,
            sampling=engine_pb2.SamplingParams(temperature=0, constraint=c),
            output_ids=pack_i32(bad),
        ),
        engine_pb2.ForwardRequest(
            req_slot=1,
            input_ids=pack_i32(prompt),
            out_slots=pack_i32(slots_b),
            is_new=True,
            sample=True,
            sampling=engine_pb2.SamplingParams(temperature=0),
        ),
    ]
    res = d.send(reqs)
    assert "replaying output token 0" in res.tokens[0].grammar_error
    assert res.tokens[1].grammar_error == "" and not res.tokens[1].grammar_terminated
    assert res.tokens[1].token_id >= 0


def test_compiler_message_strips_location():
    e = RuntimeError("[22:14:40] /project/cpp/regex_converter.cc:94: Regex parsing error")
    assert compiler_message(e) == "Regex parsing error"


def test_length_bounded_json_strings_refuse_control_characters(runner, tokenizer):
    """xgrammar 0.2.9 lets raw U+0000..U+001F into strings with minLength / maxLength;
    compiler.json_safe closes that, so every such token is masked inside the string."""
    import xgrammar as xgr

    compiled = runner.grammars.compiler.submit(
        Constraint("json_schema", '{"type": "string", "maxLength": 12}')
    ).result(30)
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string('"')
    bitmask = xgr.allocate_token_bitmask(1, runner.vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    control = [
        t
        for t in range(runner.vocab_size)
        if (s := tokenizer.decode([t])) and any(ord(ch) < 0x20 for ch in s)
    ]
    assert control
    allowed = [t for t in control if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed == []


@pytest.mark.parametrize(
    ("constraint", "rules"),
    [
        (engine_pb2.Constraint(ebnf="root ::= root"), "rule 'root' never ends"),
        (engine_pb2.Constraint(ebnf="root ::= a\na ::= root"), "rules 'root', 'a' never end"),
        (engine_pb2.Constraint(ebnf='root ::= "a" root'), "rule 'root' never ends"),
        (engine_pb2.Constraint(ebnf='root ::= x{2,3}\nx ::= "q" x'), "never end"),
        (
            engine_pb2.Constraint(
                structural_tag=_tag({"type": "grammar", "grammar": 'root ::= "a" root'})
            ),
            "never end",
        ),
        (
            engine_pb2.Constraint(
                json_schema='{"type": "object", "properties": {"a": {"$ref": "#"}}, '
                '"required": ["a"]}'
            ),
            "never end",
        ),
    ],
)
def test_a_grammar_no_finite_output_completes_is_refused(runner, constraint, rules):
    st = Driver(runner).compile("never", constraint)
    assert st.error_code == "INVALID_ARGUMENT"
    assert "accepts no finite string" in st.error and rules in st.error


@pytest.mark.parametrize(
    "constraint",
    [
        engine_pb2.Constraint(ebnf='root ::= "a" | root'),  # one way out is enough
        engine_pb2.Constraint(ebnf='root ::= x{0,3}\nx ::= "q" x'),  # zero repeats: ""
        engine_pb2.Constraint(ebnf='root ::= "a" (b | c)* [a-z]? (= "q")\nb ::= "b"+\nc ::= "c"'),
    ],
)
def test_recursive_grammars_with_a_way_out_compile(runner, constraint):
    assert Driver(runner).compile("ok", constraint).error == ""


def test_a_dead_end_mid_way_ends_that_request_as_the_constraints_fault(runner, tokenizer):
    """A matcher that allows no token (compiled around the compile-time check) ends its row
    with grammar_dead_end, unmasked (all -inf could not be sampled), batch mate untouched."""
    import xgrammar as xgr

    compiled = runner.grammars.build().compiler._compiler().compile_grammar("root ::= root")
    runner.grammars.compiler._cache[Constraint("ebnf", "dead")] = _done(compiled)
    d = Driver(runner)
    c = engine_pb2.Constraint(ebnf="dead")
    prompt = tokenizer.encode(PROMPT_TEXT)
    reqs = [
        engine_pb2.ForwardRequest(
            req_slot=slot,
            input_ids=pack_i32(prompt),
            out_slots=pack_i32(d.alloc(len(prompt))),
            is_new=True,
            sample=True,
            sampling=engine_pb2.SamplingParams(temperature=1.0, seed=1, constraint=constraint),
        )
        for slot, constraint in ((0, c), (1, None))
    ]
    res = d.send(reqs)
    assert res.tokens[0].grammar_dead_end and "allows no token" in res.tokens[0].grammar_error
    assert res.tokens[1].grammar_error == "" and not res.tokens[1].grammar_dead_end
    assert res.tokens[1].token_id >= 0
    assert isinstance(compiled, xgr.CompiledGrammar)


def _done(value):
    from concurrent.futures import Future

    fut: Future = Future()
    fut.set_result(value)
    return fut


def test_verify_rows_are_masked_draft_by_draft_and_refused_drafts_dropped(runner, tokenizer):
    """mask_drafts: row i carries the grammar's state after drafts[:i]; a draft the grammar
    refuses, and one that would end it, are cut with every draft after them; the matcher
    is left where it was (rolled back)."""
    import torch

    vocab = runner.vocab_size
    runner.grammars.slots.start(3, Constraint("regex", "ab(cd)?"), [])
    slots = runner.grammars.slots  # built by the first constraint
    a, b, c, d = (tokenizer.convert_tokens_to_ids(t) for t in "abcd")
    eos = runner.eos_token_ids[0]

    def allowed(row: torch.Tensor) -> set[int]:
        return set(torch.nonzero(row > -1e30).flatten().tolist())

    rows = torch.zeros(4, vocab)
    assert slots.mask_drafts(rows, 3, [a, b, a]) == 2  # "a" "b" taken, the second "a" refused
    first = allowed(rows[0])
    assert a in first and b not in first and b in allowed(rows[1]) and a not in allowed(rows[1])
    assert c in allowed(rows[2]) and eos in allowed(rows[2]) and a not in allowed(rows[2])
    assert torch.count_nonzero(rows[3]) == 0  # past the cut: untouched (the caller drops it)
    rows = torch.zeros(3, vocab)
    assert slots.mask_drafts(rows, 3, [a, b]) == 2
    rows = torch.zeros(4, vocab)
    assert slots.mask_drafts(rows, 3, [a, b, eos]) == 2  # the end comes as the step's own token
    again = torch.zeros(1, vocab)
    slots.mask(again, [3])  # nothing was consumed for good
    assert allowed(again[0]) == first
    assert slots.advance([3], [[a, b, eos]]) == ([True], [""])
