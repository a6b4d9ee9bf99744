"""Chat templates render exactly like transformers' apply_chat_template(tokenize=False), for
templates that use the features real models rely on: tools + tojson(indent), namespace, loop
controls, raise_exception, special-token variables, documents, extra kwargs, None fields."""

from __future__ import annotations

import pytest
from ferrox.loader.errors import ChatTemplateError
from ferrox.loader.source import resolve_model
from ferrox.loader.tokenizer import load_tokenizer

from tests.helpers import tiny_models

transformers = pytest.importorskip("transformers")

TOOLS_TEMPLATE = """{{ bos_token }}{% if tools %}<tools>
{% for tool in tools %}{{ tool | tojson(indent=2) }}
{% endfor %}</tools>
{% endif %}{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m.role == 'user' %}\
{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}\
{% if m.role not in ['system', 'user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}\
<|im_start|>{{ m.role }}
{% if m.content is string %}{{ m.content | trim }}{% endif %}{% if m.tool_calls is defined %}\
{% for call in m.tool_calls %}{% if loop.index > 2 %}{% break %}{% endif %}<call>{{ call.function | tojson }}</call>\
{% endfor %}{% endif %}{% if loop.index0 == ns.last_user %} [last user]{% endif %}<|im_end|>
{% endfor %}{% if documents %}{% for d in documents %}[doc {{ loop.index }}: {{ d.title }}]{% endfor %}{% endif %}\
{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>
{% endif %}{% endif %}{{ eos_token if not add_generation_prompt else '' }}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
MESSAGES = [
    {"role": "system", "content": "  You are helpful.  "},
    {"role": "user", "content": "Weather in Zürich? <b>now</b>"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}},
        {"type": "function", "function": {"name": "never", "arguments": {}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "user", "content": "Thanks 🙂"},
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tiny_models.make_tiny_llama(tmp_path_factory.mktemp("tmpl") / "llama")
    return load_tokenizer(resolve_model(folder)), transformers.AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("kwargs", [
    {},
    {"tools": TOOLS},
    {"tools": TOOLS, "add_generation_prompt": False},
    {"documents": [{"title": "A", "text": "x"}, {"title": "B", "text": "y"}]},
    {"enable_thinking": False},
])
def test_tools_template_matches_transformers(tokenizers, kwargs):
    ours, theirs = tokenizers
    add_gen = kwargs.pop("add_generation_prompt", True)
    a = ours.apply_chat_template(MESSAGES, chat_template=TOOLS_TEMPLATE, add_generation_prompt=add_gen, **kwargs)
    b = theirs.apply_chat_template(MESSAGES, chat_template=TOOLS_TEMPLATE, add_generation_prompt=add_gen,
                                   tokenize=False, **kwargs)
    assert a == b
    assert "Zürich" in a  # tojson keeps non-ASCII
    if "tools" in kwargs:
        assert '\n  "type": "function"' in a  # tojson(indent=2)


def test_default_template_matches_transformers(tokenizers):
    ours, theirs = tokenizers
    conv = [{"role": "user", "content": "Hi"}]
    for gen in (True, False):
        assert ours.apply_chat_template(conv, add_generation_prompt=gen) == theirs.apply_chat_template(
            conv, add_generation_prompt=gen, tokenize=False)


def test_template_error_names_model(tokenizers):
    ours, _ = tokenizers
    with pytest.raises(ChatTemplateError, match="chat template of llama: .*bad role robot"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}], chat_template=TOOLS_TEMPLATE)


def test_continue_final_message(tokenizers):
    ours, theirs = tokenizers
    conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    a = ours.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True)
    b = theirs.apply_chat_template(conv, add_generation_prompt=False, continue_final_message=True, tokenize=False)
    assert a == b and a.endswith("The answer is")


def test_named_templates_pick_tool_use(tokenizers):
    ours, _ = tokenizers
    from ferrox.loader.tokenizer import Tokenizer

    tok = Tokenizer(ours.backend, name="multi", special_tokens=ours.special_tokens, eos_token_ids=[2],
                    chat_template={"default": "D{{ messages|length }}", "tool_use": "T{{ tools|length }}"})
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "D1"
    assert tok.apply_chat_template(msgs, tools=TOOLS) == "T1"
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "T0"
