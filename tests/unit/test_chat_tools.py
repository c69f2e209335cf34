"""OpenAI tool calling on chat, without a server (services/frontend/chat_tools.py): the
request's tools, tool_choice and constraint; the chat template rendering tools, calls and
results (tests/tool_models.py); the answer read into reasoning, content and tool calls,
whole and streamed; and the reasoning-first grammars checked by xgrammar's matcher."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import xgrammar as xgr

from radixserve.v1 import generation_pb2 as pb
from services.common.config import DEFAULT_MODEL_PATH
from services.frontend.chat_tools import ChatOutput, ChatParsers
from services.frontend.openai_errors import ApiError
from services.frontend.openai_protocol import ChatCompletionRequest, chat_plan, chat_to_request
from services.frontend.pipeline import template_chat
from services.frontend.reasoning_parser import get_reasoning_parser
from services.frontend.tokenizer import ChatToolsError, Tokenizer
from services.frontend.tool_grammar import MAX_TOOLS, ToolGrammarError
from services.frontend.tool_parsers import get_tool_parser
from services.frontend.validation import ValidationError, validate_input
from services.worker.batch import Constraint
from services.worker.grammar.compiler import GrammarCompiler, TokenizerInfoSource
from tests.tool_models import TOOL_TEMPLATE, set_chat_template

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "description": "the time"}},
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
PARIS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
    "</tool_call>"
)
NOW = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
HERMES = ChatParsers(get_tool_parser("hermes"))
EOS = 0  # the default model's <|endoftext|>


def body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **kw})


def refused(parsers: ChatParsers, **kw) -> ApiError:
    with pytest.raises(ApiError) as e:
        chat_plan(body(**kw), parsers)
    assert e.value.status == 400
    return e.value


# ---- flags and requests -------------------------------------------------------------------


def test_auto_detects_the_parser_from_the_template_and_none_reads_nothing():
    assert ChatParsers.from_flags("auto", "none", TOOL_TEMPLATE).tool_parser.name == "hermes"
    assert ChatParsers.from_flags("auto", "none", "{{ messages }}").tool_parser is None
    forced = ChatParsers.from_flags("mistral", "qwen3", "{{ messages }}")
    assert forced.tool_parser.name == "mistral" and forced.reasoning.name == "qwen3"


def test_each_tool_choice_makes_its_constraint():
    shapes = {}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "now"}}):
        plan = chat_plan(body(tools=TOOLS, tool_choice=choice), HERMES)
        assert plan.tool_parser is not None and plan.structural_tag is not None
        shapes[json.dumps(choice)] = json.loads(plan.structural_tag)["format"]["type"]
    assert list(shapes.values()) == ["triggered_tags", "tags_with_separator", "tags_with_separator"]
    assert chat_plan(body(tools=TOOLS), HERMES).structural_tag is not None  # auto by default
    none = chat_plan(body(tools=TOOLS, tool_choice="none"), HERMES)
    assert none.structural_tag is None and none.output() is None  # rendered, never parsed
    assert chat_plan(body(), HERMES).output() is None  # no tools: plain content


def test_the_request_carries_tools_calls_results_and_the_constraint():
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {"id": "call_2", "function": {"name": "now", "arguments": {}}},  # an object
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    b = ChatCompletionRequest.model_validate(
        {"messages": messages, "tools": TOOLS, "tool_choice": "required"}
    )
    req = chat_to_request(b, chat_plan(b, HERMES))
    assistant, tool = req.messages.messages[1], req.messages.messages[2]
    assert [(c.id, c.name, c.arguments) for c in assistant.tool_calls] == [
        ("call_1", "get_weather", '{"city": "Paris"}'),
        ("call_2", "now", "{}"),
    ]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "sunny")
    assert [(t.name, t.description) for t in req.messages.tools] == [
        ("get_weather", ""),
        ("now", "the time"),
    ]
    assert json.loads(req.messages.tools[0].parameters) == WEATHER
    assert req.messages.tools[1].parameters == ""  # no parameters
    assert req.sampling.WhichOneof("constraint") == "structural_tag"
    conv, tools = template_chat(req.messages)
    assert conv[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # an object
    assert tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("kw", "param", "needle"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "'f'"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be"),
        ({"tools": TOOLS, "tool_choice": {"function": {}}}, "tool_choice", '"required"'),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not one of the tools (get_weather, now)",
        ),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "given twice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "1 to 64"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools", "1 to 64"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools", "'function'"),
        (
            {"tools": [{"function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]},
            "tools",
            f"at most {MAX_TOOLS} tools",
        ),
        (
            {"tools": TOOLS, "response_format": {"type": "json_object"}},
            "response_format",
            "one constraint per request",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "regex", "one constraint"),
    ],
)
def test_bad_tool_requests_are_refused_naming_the_field(kw, param, needle):
    e = refused(HERMES, **kw)
    assert e.param == param and needle in e.message, e.message


def test_the_limit_itself_is_allowed_and_none_leaves_room_for_response_format():
    many = [{"function": {"name": f"f{i}"}} for i in range(MAX_TOOLS)]
    assert chat_plan(body(tools=many), HERMES).structural_tag is not None
    rf = {"type": "json_object"}
    plan = chat_plan(body(tools=TOOLS, tool_choice="none", response_format=rf), HERMES)
    assert plan.structural_tag is None
    assert chat_to_request(body(response_format=rf), plan).sampling.json_object


def test_tools_without_a_known_parser_say_which_flag_to_set():
    e = refused(ChatParsers(), tools=TOOLS)
    assert e.param == "tools" and "--tool-call-parser" in e.message
    assert chat_plan(body(tools=TOOLS, tool_choice="none"), ChatParsers()).output() is None


def test_pythonic_calls_cannot_be_guaranteed_but_auto_reads_them():
    pythonic = ChatParsers(get_tool_parser("pythonic"))
    assert chat_plan(body(tools=TOOLS), pythonic).structural_tag is None
    e = refused(pythonic, tools=TOOLS, tool_choice="required")
    assert e.param == "tool_choice" and "use auto" in e.message


def test_a_constraint_from_the_first_token_turns_the_reasoning_split_off():
    thinking = ChatParsers(get_tool_parser("hermes"), get_reasoning_parser("deepseek_r1"))
    assert chat_plan(body(), thinking).reasoning is not None
    assert chat_plan(body(response_format={"type": "json_object"}), thinking).reasoning is None
    assert chat_plan(body(tools=TOOLS, tool_choice="required"), thinking).reasoning is not None


def test_the_deprecated_functions_point_to_tools():
    from services.frontend.openai_protocol import check_unserved

    with pytest.raises(ApiError) as e:
        check_unserved(body(functions=[{"name": "f"}]))
    assert e.value.param == "functions" and "use tools" in e.value.message
    with pytest.raises(ApiError) as e:
        check_unserved(body(function_call="auto"))
    assert "use tool_choice" in e.value.message


# ---- the chat template --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tool_tok(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tool-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(DEFAULT_MODEL_PATH) / name, folder / name)
    return Tokenizer(str(set_chat_template(folder)))


def _chat(*messages: dict, tools=TOOLS) -> pb.ChatMessages:
    b = ChatCompletionRequest.model_validate({"messages": list(messages), "tools": tools})
    return chat_to_request(b).messages


def test_the_template_renders_tools_calls_and_results(tool_tok):
    call = {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = _chat(
        *USER,
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    )
    text = tool_tok.render_chat(*template_chat(chat))
    assert '"name": "get_weather"' in text and '"maxLength": 8' in text  # the tools' JSON
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # The same ids whether content goes through the escaping path or not.
    plain = tool_tok.encode_chat(*template_chat(chat))
    assert plain == tool_tok.hf.encode(text, add_special_tokens=False)


def test_content_spelling_special_tokens_stays_plain_beside_tools(tool_tok):
    chat = _chat({"role": "user", "content": "hi<|im_end|>"})
    ids = tool_tok.encode_chat(*template_chat(chat))
    end = tool_tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(end) == 2  # the system turn's and the user turn's, not the user's text


def test_special_token_text_in_tools_is_refused(tool_tok):
    evil = [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}]
    with pytest.raises(ChatToolsError) as e:
        tool_tok.encode_chat(*template_chat(_chat(*USER, tools=evil)))
    assert e.value.field == "messages.tools[0]"


def test_a_template_that_ignores_tools_is_refused():
    plain = Tokenizer(DEFAULT_MODEL_PATH)  # its template renders messages only
    with pytest.raises(ChatToolsError) as e:
        plain.encode_chat(*template_chat(_chat(*USER)))
    assert e.value.field == "messages.tools" and "does not render tools" in str(e.value)
    assert plain.encode_chat(USER)  # without tools it serves as before


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda c: c.tools.add(name="bad name"), "messages.tools[2].name"),
        (lambda c: c.tools.add(name="now"), "messages.tools[2].name"),
        (lambda c: c.tools.add(name="g", parameters="[1]"), "messages.tools[2].parameters"),
        (
            lambda c: c.messages[0].tool_calls.add(name="now", arguments="{}"),
            "messages[0].tool_calls",
        ),
        (
            lambda c: c.messages.add(role="assistant").tool_calls.add(name="now", arguments="x"),
            "messages[1].tool_calls[0].arguments",
        ),
    ],
)
def test_grpc_requests_are_held_to_the_same_rules(edit, field):
    req = pb.GenerateRequest()
    req.messages.CopyFrom(_chat(*USER))
    edit(req.messages)
    with pytest.raises(ValidationError) as e:
        validate_input(req, vocab_size=596)
    assert e.value.field == field


# ---- the answer ---------------------------------------------------------------------------


def _streamed(output: ChatOutput, text: str, step: int) -> list[dict]:
    deltas = []
    for i in range(0, len(text), step):
        deltas += output.feed(text[i : i + step])
    return deltas + output.finish()


def test_reasoning_first_then_content_and_calls_whole_and_streamed():
    text = f"<think>Paris, so\nweather.</think>\n\nLet me look.\n{PARIS}\n{NOW}"
    reasoning, tools = get_reasoning_parser("qwen3"), get_tool_parser("hermes")
    whole = ChatOutput(reasoning, tools).whole(text)
    assert whole.reasoning == "Paris, so\nweather."
    assert whole.content.strip() == "Let me look."
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [
        ("get_weather", '{"city":"Paris","unit":"c"}'),
        ("now", "{}"),
    ]
    for step in (1, 3, 7, len(text)):
        deltas = _streamed(ChatOutput(reasoning, tools), text, step)
        assert all(len(d) == 1 for d in deltas)  # one field a delta
        assert "".join(d.get("reasoning_content", "") for d in deltas) == whole.reasoning
        assert "".join(d.get("content", "") for d in deltas) == whole.content
        items = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
        assert [i["function"].get("name") for i in items] == ["get_weather", None, "now", None]
        assert [i["index"] for i in items] == [0, 0, 1, 1]
        assert "<tool_call>" not in "".join(d.get("content", "") for d in deltas)


def test_without_a_tool_parser_the_rest_is_content():
    whole = ChatOutput(get_reasoning_parser("deepseek_r1"), None).whole(f"hmm</think>{PARIS}")
    assert (whole.reasoning, whole.content, whole.tool_calls) == ("hmm", PARIS, [])


# ---- reasoning first, then the constrained calls (xgrammar) ------------------------------


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfoSource(DEFAULT_MODEL_PATH, 596, [EOS]), 32, 1)


def allows(compiler: GrammarCompiler, tag: str | None, output: str) -> bool:
    assert tag is not None
    m = xgr.GrammarMatcher(compiler.submit(Constraint("structural_tag", tag)).result(30))
    return m.accept_string(output) and (m.is_terminated() or m.accept_token(EOS))


def _tag(reasoning: str, choice) -> str | None:
    parsers = ChatParsers(get_tool_parser("hermes"), get_reasoning_parser(reasoning))
    return chat_plan(body(tools=TOOLS, tool_choice=choice), parsers).structural_tag


def test_the_thinking_stays_free_and_the_calls_after_it_are_held(compiler):
    tag = _tag("qwen3", "required")
    for ok in (PARIS, f"<think>any <tool_call> text</think>\n\n{PARIS}", f"<think></think>{NOW}"):
        assert allows(compiler, tag, ok), ok
    for bad in (f"<think>x</think>\n\nSure. {PARIS}", "<think>x</think>", f"x{PARIS}"):
        assert not allows(compiler, tag, bad), bad
    auto = _tag("qwen3", "auto")
    assert allows(compiler, auto, "<think>x</think>\n\nIt is sunny.")
    assert allows(compiler, auto, f"<think>x</think>\n\nLet me look. {PARIS}")


def test_an_implicit_start_must_close_the_thinking_before_the_call(compiler):
    tag = _tag("deepseek_r1", {"type": "function", "function": {"name": "now"}})
    assert allows(compiler, tag, f"so: the time</think>\n\n{NOW}")
    assert not allows(compiler, tag, NOW) and not allows(compiler, tag, f"x</think>{PARIS}")


def test_tool_grammar_errors_keep_their_field():
    with pytest.raises(ToolGrammarError) as e:
        HERMES.plan([{"function": {"name": "f"}}] * 2, "auto", True)
    assert e.value.param == "tools"


def test_a_grammar_over_the_constraint_limit_blames_the_tools():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(60)}}
    tools = [{"function": {"name": f"f{i}", "parameters": wide}} for i in range(100)]
    e = refused(HERMES, tools=tools)
    assert e.param == "tools" and "send fewer tools or smaller schemas" in e.message
