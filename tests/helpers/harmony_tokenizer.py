"""A tiny stand-in for gpt-oss's o200k_harmony tokenizer: the tiny byte-level BPE of tiny_models.py
with harmony's seven markers as added special tokens and `analysis` as one token (as in o200k, where
the channel name is a single token after `<|channel|>`).

    tok = build_harmony_tokenizer()               # a `tokenizers.Tokenizer`
    ids = tok.encode(HARMONY_REPLY).ids           # markers are single ids
    tok.decode(ids, skip_special_tokens=False)    # the text the server's parsers read
"""

from __future__ import annotations

from tests.helpers.tiny_models import build_tokenizer

HARMONY_MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

# A reply with every kind of message: thinking, a preamble, a tool call, and (another turn) an answer.
THINK = "The user asks about Paris. I should call the tool."
PREAMBLE = "Let me check the weather."
ARGS = '{"city": "Paris", "days": [1, 2]}'
HARMONY_TOOL_REPLY = (
    f"<|channel|>analysis<|message|>{THINK}<|end|>"
    f"<|start|>assistant<|channel|>commentary<|message|>{PREAMBLE}<|end|>"
    f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"
)
ANSWER = "Paris is sunny: 21 C, café weather."
HARMONY_ANSWER_REPLY = (
    f"<|channel|>analysis<|message|>{THINK}<|end|>"
    f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
)


def build_harmony_tokenizer():
    from tokenizers import AddedToken

    tok = build_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_MARKERS])
    tok.add_tokens([AddedToken("analysis", special=False, normalized=False)])
    return tok


def token_pieces(tok, text: str) -> list[str]:
    """`text` as the detokenizer hands it out, one token at a time (markers whole)."""
    ids = tok.encode(text, add_special_tokens=False).ids
    pieces, prev = [], ""
    for n in range(1, len(ids) + 1):
        full = tok.decode(ids[:n], skip_special_tokens=False)
        if full.endswith("\ufffd"):  # a character split over tokens: wait for its last byte
            continue
        pieces.append(full[len(prev):])
        prev = full
    return pieces


# A small harmony chat template written for these tests (gpt-oss's own is longer): the variables it
# reads are the ones gpt-oss's reads (reasoning_effort, model_identity, tools, an assistant turn's
# thinking and its tool call's arguments as an object).
HARMONY_TEMPLATE = (
    "{{ '<|start|>system<|message|>' + (model_identity | default('You are a tiny test model.')) + '\\n' }}"
    "{{ 'Reasoning: ' + (reasoning_effort | default('medium')) + '\\n' }}"
    "{{ '# Valid channels: analysis, commentary, final.<|end|>' }}"
    "{% if tools %}{{ '<|start|>developer<|message|># Tools\\n' }}"
    "{% for t in tools %}{{ 'type ' + t.function.name + '\\n' }}{% endfor %}{{ '<|end|>' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}"
    "{% if m.thinking %}{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' }}{% endif %}"
    "{% set call = m.tool_calls[0].function %}"
    "{{ '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' }}"
    "{{ call.arguments | tojson }}{{ '<|call|>' }}"
    "{% elif m.role == 'assistant' %}{{ '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"
    "{% elif m.role == 'tool' %}{{ '<|start|>functions.x to=assistant<|channel|>commentary<|message|>' }}"
    "{{ m.content + '<|end|>' }}"
    "{% else %}{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)


def make_tiny_harmony_llama(folder, *, seed: int = 0) -> str:
    """A tiny random Llama speaking through the harmony tokenizer, with HARMONY_TEMPLATE and gpt-oss's
    stop tokens (`<|return|>`, `<|call|>`) as its eos, as gpt-oss's generation_config has them."""
    import json
    import os

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers.tiny_models import _common, _save

    tok = build_harmony_tokenizer()
    config = LlamaConfig(**_common(tok, 64, 2, 4, 2, 128, 2048, False), rope_parameters={"rope_type": "default",
                                                                                       "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    stops = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    _save(str(folder), model, tok, max_shard_size=None, generation={"eos_token_id": stops})
    path = os.path.join(str(folder), "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        config_json = json.load(f)
    config_json.update(chat_template=HARMONY_TEMPLATE, eos_token="<|return|>")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config_json, f, indent=2)
    return str(folder)
