"""HTTP answers of the real frontend over the scripted scheduler, recorded to prove a
refactor changed none: every case's status, content type and body (ids, timestamps and
timings masked), OpenAI and SGLang routes, streams and refusals alike.

    python scripts/record_http.py OUT.json           # from the repository root
    git worktree add /tmp/old <commit> && (cd /tmp/old && python /path/to/this OLD.json)
    cmp OUT.json OLD.json
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the checkout being recorded, not this file's

import httpx  # noqa: E402

from tests.fake_scheduler import (  # noqa: E402
    SCRIPT_TEXT,
    FakeScheduler,
    FrontendThread,
    build_tokenizer,
    frontend_config,
)

M = "tiny"  # the scripted frontend's served model name
CHAT = [{"role": "user", "content": "hi"}]
CASES: list[tuple[str, str, object]] = [
    ("GET", "/v1/models", None),
    ("GET", "/health", None),
    ("GET", "/get_model_info", None),
    ("GET", "/openapi.json", None),
    ("POST", "/v1/completions", {"model": M, "prompt": "hello", "max_tokens": 5}),
    (
        "POST",
        "/v1/completions",
        {
            "model": M,
            "prompt": "hello",
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "POST",
        "/v1/completions",
        {"model": M, "prompt": ["a", "b"], "max_tokens": 3, "echo": True, "logprobs": 2},
    ),
    (
        "POST",
        "/v1/completions",
        {"model": M, "prompt": "x", "max_tokens": 6, "n": 2, "stop": ["zz"], "temperature": 0},
    ),
    ("POST", "/v1/chat/completions", {"model": M, "messages": CHAT, "max_tokens": 5}),
    (
        "POST",
        "/v1/chat/completions",
        {
            "model": M,
            "messages": CHAT,
            "max_tokens": 4,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    (
        "POST",
        "/v1/chat/completions",
        {"model": M, "messages": CHAT, "max_tokens": 4, "response_format": {"type": "json_object"}},
    ),
    ("POST", "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}}),
    (
        "POST",
        "/generate",
        {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
    ),
    (
        "POST",
        "/generate",
        {
            "input_ids": [5, 6, 7],
            "stream": True,
            "sampling_params": {"max_new_tokens": 3},
            "return_logprob": True,
        },
    ),
    # refusals: each names its field
    ("POST", "/v1/completions", {"model": M, "prompt": "x", "temperature": 5000}),
    ("POST", "/v1/completions", {"model": M, "prompt": "x", "top_p": 0}),
    ("POST", "/v1/completions", {"model": M, "prompt": "x", "logit_bias": {"abc": 1}}),
    ("POST", "/v1/completions", {"model": M, "prompt": "x", "max_tokens": -1}),
    ("POST", "/v1/completions", {"model": M, "prompt": "x", "no_such_field": 1}),
    ("POST", "/v1/chat/completions", {"model": M, "messages": [{"role": 7}]}),
    ("POST", "/v1/chat/completions", {"model": M, "messages": CHAT, "n": 0}),
    ("POST", "/generate", {"text": "x", "sampling_params": {"top_k": 0}}),
    ("POST", "/generate", {"text": "x", "sampling_params": {"min_p": 2}}),
    ("POST", "/generate", {}),
    ("POST", "/v1/completions", "not json"),
    ("GET", "/no/such/route", None),
    ("DELETE", "/v1/completions", None),
]
MASKS = [
    (re.compile(r'"(id|system_fingerprint)": ?"[^"]*"'), r'"\1": "X"'),
    (re.compile(r'"created": ?\d+'), '"created": 0'),
    (re.compile(r'"(\w*(?:time|latency)\w*)": ?[0-9.e+-]+'), r'"\1": 0'),
    (re.compile(r"(cmpl|chatcmpl|req)-[0-9a-f]{8,}"), r"\1-X"),
]


def masked(text: str) -> str:
    for pattern, repl in MASKS:
        text = pattern.sub(repl, text)
    return text


def record(base: str) -> list[dict]:
    out = []
    with httpx.Client(base_url=base, timeout=20) as http:
        for method, path, body in CASES:
            kw = {"content": body} if isinstance(body, str) else {"json": body}
            r = http.request(method, path, **(kw if body is not None else {}))
            out.append({
                "case": f"{method} {path} {json.dumps(body)[:200]}",
                "status": r.status_code,
                "type": r.headers.get("content-type", ""),
                "body": masked(r.text),
            })  # fmt: skip
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = build_tokenizer(Path(tmp))
        from services.frontend.tokenizer import Tokenizer

        tok = Tokenizer(str(tok_dir))
        fake = FakeScheduler(tok.encode(SCRIPT_TEXT), tok.vocab_size).start()
        fe = FrontendThread(frontend_config(tok_dir, [fake], http=True)).start().wait_ready()
        try:
            cases = record(fe.http_base)
        finally:
            fe.stop()
            fake.stop()
    Path(sys.argv[1]).write_text(json.dumps(cases, indent=1))
    print(f"{len(cases)} cases: " + " ".join(str(c["status"]) for c in cases))


if __name__ == "__main__":
    main()
