"""SGLang programs, run by SGLang's own frontend language (``sgl.RuntimeEndpoint``), against
the three real processes through the native API (services/frontend/http_native.py).

The embedded default model (radixserve-zen, a small Llama trained on the Zen of Python)
serves, so greedy answers are known lines of the Zen. ``select`` is checked against the
same model's logprobs in transformers; the cache effect of ``fork`` and of multi-turn chat
is read from each request's ``cached_tokens`` and from the scheduler's metrics.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import jsonschema
import pytest
import sglang as sgl  # SGLang's frontend language itself (make setup installs it)
import torch
from sglang.lang.chat_template import get_chat_template, get_chat_template_by_model_path
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.server_util import DEFAULT_MODEL, REPO, Server, scrape_metrics

pytestmark = pytest.mark.slow

ZEN = (
    "Beautiful is better than ugly.\nExplicit is better than implicit.\n"
    "Simple is better than complex.\n"
)


@pytest.fixture(scope="module")
def server():
    with Server("--max-total-tokens", "8192", metrics=True) as s:
        yield s


@pytest.fixture(scope="module")
def backend(server):
    # The client picks a chat template by the model path; "radixserve-zen" matches none of
    # its patterns (test_the_chat_template_the_client_needs), so name it.
    return sgl.RuntimeEndpoint(f"http://127.0.0.1:{server.http_port}", chat_template_name="chatml")


@pytest.fixture(scope="module")
def hf_tok():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def hf_model():
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()


def _ids(tok, text: str) -> list[int]:
    return list(tok.encode(text))  # what the frontend does with a text prompt


def _cached_total(server) -> float:
    return scrape_metrics(server.sched_metrics)["radixserve:cached_tokens_total"]


# ---- gen -----------------------------------------------------------------------------


@sgl.function
def complete_line(s, prompt, **gen_args):
    s += prompt
    s += sgl.gen("out", **gen_args)


def test_gen_with_stop_and_max_tokens(backend):
    state = complete_line.run(
        "Beautiful is better than", stop=".", max_tokens=16, temperature=0, backend=backend
    )
    assert state["out"] == " ugly"
    meta = state.get_meta_info("out")
    assert meta["finish_reason"] == {"type": "stop", "matched": "."}
    state = complete_line.run(
        "Beautiful is better than", max_tokens=3, temperature=0, backend=backend
    )
    meta = state.get_meta_info("out")
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["completion_tokens"] == 3 and state["out"].startswith(" ugly")


def test_gen_with_logprobs_of_prompt_and_output(backend, hf_tok, hf_model):
    prompt = "Beautiful is better than"
    state = complete_line.run(
        prompt,
        max_tokens=4,
        temperature=0,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
        return_text_in_logprobs=True,
        backend=backend,
    )
    meta = state.get_meta_info("out")
    ids = _ids(hf_tok, prompt)
    inputs, outputs = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert [e[1] for e in inputs] == ids and [e[2] for e in inputs] == [
        hf_tok.decode([i]) for i in ids
    ]
    assert inputs[0][0] is None and meta["input_top_logprobs"][0] is None  # nothing before it
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]
    want = torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])
    assert [e[0] for e in inputs[1:]] == pytest.approx(want[:, 0].tolist(), abs=1e-4)
    assert len(outputs) == meta["completion_tokens"] == 4
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    assert "".join(e[2] for e in outputs) == state["out"]


def test_streamed_gen_equals_the_whole_answer(backend):
    # 48 tokens: on a loaded machine the frontend may send a few steps' text in one chunk
    # (12 once arrived as one), but never all of a longer answer.
    n = 48
    whole = complete_line.run(
        ZEN + "Complex", max_tokens=n, temperature=0, ignore_eos=True, backend=backend
    )
    state = complete_line.run(
        ZEN + "Complex", max_tokens=n, temperature=0, ignore_eos=True, stream=True, backend=backend
    )
    pieces = list(state.text_iter(var_name="out"))
    assert len(pieces) > 1  # it really streamed
    assert "".join(pieces) == whole["out"]
    assert state.get_meta_info("out")["finish_reason"] == {"type": "length", "length": n}


def test_gen_with_a_regex_and_a_json_schema(backend):
    state = complete_line.run(
        "The answer is ", regex=r"[0-9]{3}", max_tokens=8, temperature=0, backend=backend
    )
    assert re.fullmatch(r"[0-9]{3}", state["out"]), state["out"]
    schema = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    state = complete_line.run(
        "As JSON: ", json_schema=json.dumps(schema), max_tokens=48, temperature=0, backend=backend
    )
    jsonschema.validate(json.loads(state["out"]), schema)
    assert state.get_meta_info("out")["finish_reason"]["type"] == "stop"  # the grammar ended it


@sgl.function
def numbered(s, i):
    s += f"{ZEN}Line {i}:"
    s += sgl.gen("out", max_tokens=6)


def test_run_batch_of_16(backend):
    states = numbered.run_batch(
        [{"i": i} for i in range(16)], temperature=0, backend=backend, num_threads=16
    )
    assert len(states) == 16
    metas = [s.get_meta_info("out") for s in states]
    assert all(m["finish_reason"] is not None and m["completion_tokens"] >= 1 for m in metas)
    # Greedy and deterministic: the same prompt answers the same in a batch and alone.
    alone = numbered.run(i=7, temperature=0, backend=backend)
    assert states[7]["out"] == alone["out"]
    # Sixteen prompts sharing the Zen prefix: all but the first few hit it in the cache.
    assert sum(m["cached_tokens"] > 0 for m in metas) >= 12


# ---- select --------------------------------------------------------------------------


@sgl.function
def choose(s, prompt, choices):
    s += prompt
    s += sgl.select("pick", choices=choices)


def _hf_normalized(model, tok, prefix: str, choices: list[str]) -> list[float]:
    """What SGLang's client computes from /generate's logprobs, computed with transformers:
    the mean logprob of each choice's tokens from two before the prefix's end (position 0,
    which has no logit, left out), less the first if the prefix ends with its text."""
    start = max(len(_ids(tok, prefix)) - 2, 0)
    scores = []
    for c in choices:
        ids = _ids(tok, prefix + c)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        lps = torch.log_softmax(logits, -1)
        entries = [
            (lps[p - 1, ids[p]].item() if p > 0 else None, tok.decode([ids[p]]))
            for p in range(start, len(ids))
        ]
        values = [lp for lp, _ in entries if lp]
        score = sum(values) / len(values)
        first_lp, first_text = entries[0]
        if prefix.endswith(first_text) and first_lp is not None:
            score = (score * len(entries) - first_lp) / (len(entries) - 1)
        scores.append(score)
    return scores


SELECTS = [
    ("Beautiful is better than", [" ugly.", " implicit.", " complex.", " nested."]),
    (ZEN + "Flat is better than", [" nested.", " sparse.", " dense."]),
    (
        "Errors should never pass",
        [" silently.", " loudly.", " at all.", " twice.", " by."],
    ),
]


@pytest.mark.parametrize(("prefix", "choices"), SELECTS)
def test_select_picks_the_argmax_of_the_models_normalized_logprobs(
    backend, hf_tok, hf_model, prefix, choices
):
    want = _hf_normalized(hf_model, hf_tok, prefix, choices)
    state = choose.run(prefix, choices, backend=backend)
    got = state.get_meta_info("pick")["normalized_prompt_logprobs"]
    assert got == pytest.approx(want, abs=1e-3)
    assert state["pick"] == choices[max(range(len(choices)), key=want.__getitem__)]


# ---- fork ----------------------------------------------------------------------------


BRANCHES = ["Flat is better than", "Sparse is better than", "Readability", "Errors should"]


@sgl.function
def forked(s):
    s += ZEN + "Flat is better than" + sgl.gen("first", max_tokens=8, stop="\n") + "\n"
    forks = s.fork(len(BRANCHES))
    for f, start in zip(forks, BRANCHES, strict=True):
        f += start
        f += sgl.gen("line", max_tokens=8, stop="\n")
    metas = [f.get_meta_info("line") for f in forks]  # each branch's request
    forks.join()
    return metas


def test_fork_into_four_branches_that_hit_the_shared_prefix(backend, server, hf_tok):
    backend.flush_cache()
    before = _cached_total(server)
    state = forked.run(temperature=0, backend=backend)
    state.sync()  # run() returns once the program is queued, not done
    reused = _cached_total(server) - before
    lines, metas = state["line"], state.ret_value
    assert state["first"] == " nested."  # the Zen, greedily
    assert len(lines) == len(BRANCHES) and all(lines)
    # Reusing the prefix changes nothing: each branch says what the whole text says alone.
    stem = ZEN + "Flat is better than" + state["first"] + "\n"
    for line, start in zip(lines, BRANCHES, strict=True):
        alone = complete_line.run(
            stem + start, max_tokens=8, stop="\n", temperature=0, backend=backend
        )
        assert alone["out"] == line
    # The branches share everything before their own line: the first gen's prompt and
    # answer, which are in the tree since it finished (and fork() may also have sent the
    # prefix alone, max_new_tokens 0). Each branch reuses all of it.
    first = state.get_meta_info("first")
    shared = first["prompt_tokens"] + first["completion_tokens"] - 2
    for meta in metas:
        assert meta["cached_tokens"] >= shared, (meta, first)
    # The metrics count the same reuse (the first request found an empty tree).
    assert first["cached_tokens"] == 0
    assert reused == sum(m["cached_tokens"] for m in metas)


# ---- chat ----------------------------------------------------------------------------

QUESTIONS = ["What is better than ugly?", "And than implicit?", "And than complex?"]
SYSTEM = "You recite the Zen of Python."


@sgl.function
def chat(s, questions):
    s += sgl.system(SYSTEM)
    for i, q in enumerate(questions):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen(f"a{i}", max_tokens=12))


def _conversation(answers: list[str]) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for q, a in zip(QUESTIONS, answers, strict=True):
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs


def test_the_chat_template_the_client_needs(hf_tok):
    """The client guesses a template from the model path; for radixserve-zen it guesses its
    SYSTEM:/USER: default, which is not the model's. Its chatml is the model's exactly."""
    msgs = _conversation(["Beautiful.", "Explicit.", "Simple."])
    model_text = hf_tok.apply_chat_template(msgs, tokenize=False)
    guessed = get_chat_template_by_model_path("radixserve-zen")
    assert guessed.name == "default" and guessed.get_prompt(msgs) != model_text
    assert get_chat_template("chatml").get_prompt(msgs) == model_text


def test_three_turn_chat_reuses_each_turn(backend, server, hf_tok):
    backend.flush_cache()
    before = _cached_total(server)
    state = chat.run(QUESTIONS, temperature=0, backend=backend)
    state.sync()
    reused = _cached_total(server) - before
    answers = [state[f"a{i}"] for i in range(3)]
    assert all(answers)
    # What the client sent is the model's own chat template, turn by turn.
    assert state.text() == hf_tok.apply_chat_template(_conversation(answers), tokenize=False)
    metas = [state.get_meta_info(f"a{i}") for i in range(3)]
    assert all(m["finish_reason"] is not None for m in metas)
    assert metas[0]["cached_tokens"] == 0
    for prev, nxt in zip(metas, metas[1:], strict=False):
        # Turn n+1 finds turn n in the tree: its prompt and (but for a token or two where
        # the answer is tokenized again) its answer.
        assert nxt["cached_tokens"] >= prev["prompt_tokens"] + prev["completion_tokens"] - 2
    assert reused == sum(m["cached_tokens"] for m in metas)


# ---- SGLang's newest client (0.5.x) -------------------------------------------------------

NEXT_SITE = REPO / ".sglang-next" / "site"


def test_a_two_turn_chat_and_stop_regex_on_the_newest_client(server, hf_tok):
    """0.5.x's client sends stop_regex (empty for none) in every gen: tests/e2e/
    sglang_next_client.py runs its programs in a subprocess that imports it instead."""
    if not (NEXT_SITE / "sglang").is_dir():
        pytest.skip("no .sglang-next/site: `make sglang-next` could not install SGLang 0.5.x")
    url = f"http://127.0.0.1:{server.http_port}"
    run = subprocess.run(
        [sys.executable, str(REPO / "tests/e2e/sglang_next_client.py"), url],
        env={**os.environ, "PYTHONPATH": str(NEXT_SITE)},
        cwd=NEXT_SITE,  # not the repo: its tests/ must not shadow anything
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["version"].startswith("0.5.")
    msgs = [{"role": "system", "content": "You recite the Zen of Python."}]
    questions = ["What is better than ugly?", "And than implicit?"]
    for q, a in zip(questions, got["answers"], strict=True):
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    assert got["chat_text"] == hf_tok.apply_chat_template(msgs, tokenize=False)
    first, second = got["chat_metas"]
    assert first["finish_reason"]["type"] == second["finish_reason"]["type"] == "stop"
    assert second["cached_tokens"] >= first["prompt_tokens"] + first["completion_tokens"] - 2
    # The Zen goes on " better than implicit.": cut before the match, the pattern reported.
    assert got["regex_out"] == " better "
    assert got["regex_meta"]["finish_reason"] == {"type": "stop", "matched": r"\bthan\b"}


def test_abort_request_ends_a_running_generate_and_frees_its_kv(server):
    base = f"http://127.0.0.1:{server.http_port}"
    body = {
        "text": "Beautiful",
        "rid": "to-abort",
        "stream": True,
        "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
    }
    started, events = threading.Event(), []

    def stream() -> None:
        with httpx.stream("POST", base + "/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    started.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(30)
    r = httpx.post(base + "/abort_request", json={"rid": "to-abort"}, timeout=10)
    reader.join(30)
    assert r.status_code == 200 and r.json() == {"aborted": ["to-abort"]}
    meta = events[-1]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 500
    for _ in range(50):  # the cancel path: soon nothing is running or held
        sched = scrape_metrics(server.sched_metrics)
        if sched["radixserve:num_running_reqs"] == sched["radixserve:kv_used_tokens"] == 0:
            break
        time.sleep(0.1)
    assert sched["radixserve:num_running_reqs"] == 0 and sched["radixserve:kv_used_tokens"] == 0


# ---- bad input -----------------------------------------------------------------------

BAD = [
    ({}, "text"),
    ({"text": ""}, "text"),
    ({"text": "x", "input_ids": [1]}, "text"),
    ({"input_ids": [99999]}, "input_ids[0]"),
    ({"input_ids": [[1, 2], []]}, "input_ids[1]"),
    ({"text": "x", "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 10**6}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "x", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"text": "x", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"text": "x", "sampling_params": {"min_p": 2}}, "sampling_params.min_p"),
    ({"text": "x", "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"text": "x", "sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
    ({"text": "x", "sampling_params": {"n": 500}}, "sampling_params.n"),
    (
        {"text": "x", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}},
        "min_new_tokens",
    ),
    ({"text": "x", "sampling_params": {"stop": [""]}}, "sampling_params.stop[0]"),
    ({"text": "x", "sampling_params": {"stop_token_ids": [99999]}}, "stop_token_ids"),
    ({"text": "x", "sampling_params": {"regex": "("}}, "sampling_params.regex"),
    ({"text": "x", "sampling_params": {"json_schema": "{nope"}}, "sampling_params.json_schema"),
    ({"text": "x", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "at most one"),
    ({"text": "x", "return_logprob": True, "logprob_start_len": 1000}, "logprob_start_len"),
    ({"text": "x", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
    ({"text": "word " * 10_000}, "text"),
    ({"text": "x", "image_data": "cat.png"}, "image_data"),
    ({"text": ["a", "b"], "stream": True}, "stream"),
    ({"text": "x", "sampling_params": {"stop_regex": "("}}, "sampling_params.stop_regex[0]"),
    ({"text": "x", "sampling_params": {"logit_bias": {"99999": 1}}}, "logit_bias"),
]


def test_bad_inputs_are_400_with_a_message_and_the_server_keeps_serving(server):
    base = f"http://127.0.0.1:{server.http_port}"
    with httpx.Client(base_url=base, timeout=60) as http:
        for body, field in BAD:
            r = http.post("/generate", json=body)
            assert r.status_code == 400, (body, r.text)
            message = r.json()["error"]["message"]
            assert field in message, (body, message)
        r = http.post("/generate", content=b"{not json")
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        # A failure after the stream started is its last event, then [DONE].
        body = {"text": "x", "stream": True, "sampling_params": {"regex": "("}}
        with http.stream("POST", "/generate", json=body) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        assert r.status_code == 200 and events[-1] == "data: [DONE]"
        assert "regex" in json.loads(events[-2][5:])["error"]["message"]
        ok = http.post(
            "/generate",
            json={"text": "Beautiful is better than", "sampling_params": {"max_new_tokens": 2}},
        )
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
