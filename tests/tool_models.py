"""A tool-calling chat template for tests, and the tiny models and tokenizers that carry it.

TOOL_TEMPLATE writes tool calls the Hermes / Qwen2.5 way (what ``--tool-call-parser auto``
detects as ``hermes``): the tools' JSON inside <tools></tools> in the system turn, an
assistant's calls as ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, and
each tool result as a user turn inside <tool_response></tool_response>. Written for
radixserve's tests over the default model's <|im_start|>/<|im_end|> tokens.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call these functions; their signatures, one a line:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\nTo call one, answer <tool_call>\\n"
    '{"name": <name>, "arguments": <arguments object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content"
    " + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.content %}{{- message.content + '\\n' }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- if not loop.first %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \''
    " + (call.function.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def set_chat_template(folder: Path, template: str = TOOL_TEMPLATE) -> Path:
    """Gives the tokenizer saved in ``folder`` this chat template (saved back in place)."""
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = template
    tok.save_pretrained(str(folder))
    return folder


def make_tiny_tool_model(folder: Path, seed: int = 0) -> Path:
    """A tiny random Llama over the default tokenizer, with TOOL_TEMPLATE and a context
    that holds the tools' JSON in the prompt."""
    from tests.conftest import make_tiny_zen_model

    make_tiny_zen_model(folder, seed=seed, max_position_embeddings=2048)
    return set_chat_template(folder)
