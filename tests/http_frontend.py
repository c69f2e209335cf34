"""The real frontend over the scripted scheduler (tests/fake_scheduler.py), as fixtures for
the HTTP test modules. Each module that calls ``openai_frontend_fixtures()`` gets its own
module-scoped set:

    tok, fake, frontend, client = openai_frontend_fixtures()

- ``tok``: (tokenizer folder, Tokenizer) of the tiny test tokenizer;
- ``fake``: a started FakeScheduler that streams SCRIPT_TEXT's tokens;
- ``frontend``: a FrontendThread serving HTTP on loopback in front of it;
- ``client``: an ``openai.OpenAI`` client of that frontend (no retries, 20 s timeout).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

from services.frontend.tokenizer import Tokenizer

try:
    from tests.fake_scheduler import (
        SCRIPT_TEXT,
        FakeScheduler,
        FrontendThread,
        build_tokenizer,
        frontend_config,
    )
except ImportError:  # run with tests/ itself on the path
    from fake_scheduler import (
        SCRIPT_TEXT,
        FakeScheduler,
        FrontendThread,
        build_tokenizer,
        frontend_config,
    )


def openai_frontend_fixtures() -> tuple[Callable[..., Any], ...]:
    """Fresh fixture functions (tok, fake, frontend, client) for the calling module."""

    @pytest.fixture(scope="module")
    def tok(tmp_path_factory):
        path = build_tokenizer(tmp_path_factory.mktemp("model"))
        return path, Tokenizer(str(path))

    @pytest.fixture(scope="module")
    def fake(tok):
        f = FakeScheduler(tok[1].encode(SCRIPT_TEXT), tok[1].vocab_size).start()
        yield f
        f.stop()

    @pytest.fixture(scope="module")
    def frontend(tok, fake):
        fe = FrontendThread(frontend_config(tok[0], [fake], http=True)).start().wait_ready()
        yield fe
        fe.stop()

    @pytest.fixture(scope="module")
    def client(frontend):
        return openai.OpenAI(
            base_url=frontend.http_base + "/v1", api_key="none", max_retries=0, timeout=20
        )

    return tok, fake, frontend, client
