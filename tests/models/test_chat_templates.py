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


# ---- message contents as strings or OpenAI parts (--chat-template-content-format) -------------------------

PARTS_TEMPLATE = ("{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}"
                  "{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}\n{% endfor %}")
PARTS = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
         {"role": "tool", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]}]


@pytest.mark.parametrize(("template", "want"), [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
    (PARTS_TEMPLATE, "openai"),
    ("{% for message in messages %}{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}"
     "{{ c['text'] }}{% endfor %}{% endfor %}", "openai"),  # Llama 4's shape
    ("{% for m in messages %}{% set parts = m.content %}{% for p in parts %}{{ p.text }}{% endfor %}{% endfor %}",
     "openai"),
    ("{% for p in messages[0]['content'] %}{{ p.text }}{% endfor %}", "openai"),  # a system message's parts
    ("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for p in m.content %}{{ p.text }}"
     "{% endfor %}{% endfor %}", "openai"),
    # Qwen3's: the content is split, not looped over; a loop over a split string is no loop over parts.
    ("{% for m in messages %}{% set c = m.content.split('</think>')[-1] %}{{ c }}{% endfor %}", "string"),
    ("{% for m in messages %}{% for line in m.content.split('\\n') %}{{ line }}{% endfor %}{% endfor %}", "string"),
    ("{% for m in messages %}{% for call in m.tool_calls %}{{ call }}{% endfor %}{% endfor %}", "string"),
    ("{% for x in", "string"),  # does not parse: rendering says why
])
def test_content_format_detection(template, want):
    from ferrox.loader.chat_template import detect_content_format

    assert detect_content_format(template) == want


def test_content_formats_render_like_transformers_given_that_shape(tokenizers):
    ours, theirs = tokenizers
    # openai (auto picks it for this template): strings become one text part; tool results stay strings.
    as_parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, PARTS[1],
                {"role": "tool", "content": "r1\nr2"}]
    want = theirs.apply_chat_template(as_parts, chat_template=PARTS_TEMPLATE, tokenize=False)
    assert ours.apply_chat_template(PARTS, chat_template=PARTS_TEMPLATE) == want == (
        "system:[Be brief.]user:[a][b]tool:r1\nr2")  # (trim_blocks eats the newline after a block tag)
    assert ours.apply_chat_template(PARTS, chat_template=PARTS_TEMPLATE, content_format="openai") == want
    # string: text parts joined by newlines (vLLM's joiner).
    as_strings = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb"},
                  {"role": "tool", "content": "r1\nr2"}]
    want = theirs.apply_chat_template(as_strings, chat_template=PARTS_TEMPLATE, tokenize=False)
    assert ours.apply_chat_template(PARTS, chat_template=PARTS_TEMPLATE, content_format="string") == want
    assert ours.apply_chat_template(PARTS, add_generation_prompt=False) == theirs.apply_chat_template(
        as_strings, add_generation_prompt=False, tokenize=False)  # the model's own template: string


def test_content_format_errors_name_the_field(tokenizers):
    ours, _ = tokenizers
    with pytest.raises(ChatTemplateError, match="chat_template_content_format must be one of"):
        ours.apply_chat_template(PARTS, content_format="parts")
    image = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}]
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.content\[1\]: content part type 'image_url'"):
        ours.apply_chat_template(image)
