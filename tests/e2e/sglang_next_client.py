"""SGLang programs on SGLang's newest frontend language (0.5.x), run in a subprocess by
tests/e2e/test_sglang_programs.py with PYTHONPATH=.sglang-next/site (`make test` installs
it there, beside .venv's 0.4.10). Not a test module itself: it prints what the programs
produced as one JSON object for the test to check.

    python tests/e2e/sglang_next_client.py http://127.0.0.1:30080
"""

from __future__ import annotations

import json
import sys

import sglang as sgl

SYSTEM = "You recite the Zen of Python."
QUESTIONS = ["What is better than ugly?", "And than implicit?"]


@sgl.function
def chat(s):
    s += sgl.system(SYSTEM)
    for i, q in enumerate(QUESTIONS):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen(f"a{i}", max_tokens=12))


@sgl.function
def until_regex(s):
    s += "Beautiful is better than ugly.\nExplicit is"
    s += sgl.gen("out", max_tokens=24, stop_regex=r"\bthan\b")


def main(url: str) -> None:
    backend = sgl.RuntimeEndpoint(url, chat_template_name="chatml")
    talk = chat.run(temperature=0, backend=backend)
    talk.sync()
    stopped = until_regex.run(temperature=0, backend=backend)
    out = {
        "version": sgl.__version__,
        "chat_text": talk.text(),
        "answers": [talk[f"a{i}"] for i in range(len(QUESTIONS))],
        "chat_metas": [talk.get_meta_info(f"a{i}") for i in range(len(QUESTIONS))],
        "regex_out": stopped["out"],
        "regex_meta": stopped.get_meta_info("out"),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
