"""vLLM drop-in behaviour of the offline API and of the structured-output options, on the real engine
and llguidance with the embedded model's tokenizer."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest
from ferrox import LLM
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.structured import build_structured_outputs
from ferrox.errors import InvalidArgumentError
from ferrox.loader.model_loader import load_generation_config
from ferrox.loader.source import resolve_model
from ferrox.structured.backend import grammar_text

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_empty_batches_return_nothing(llm):
    assert llm.generate([]) == []
    assert llm.chat([]) == []
    assert not llm.engine.has_unfinished_requests()


def test_embedded_model_ships_its_generation_defaults(llm):
    config = load_generation_config(resolve_model(None))
    assert config["temperature"] == 0.2 and config["top_p"] == 0.9 and config["eos_token_id"]
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p) == (0.2, 0.9)


def test_generation_config_engine_arguments():
    """vLLM's generation_config / override_generation_config engine arguments on the offline LLM: 'vllm'
    drops the model's defaults, the override lays its own on top; a bad one fails before the model loads."""
    llm = LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=512, generation_config="vllm",
              override_generation_config={"top_k": 7})
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 7)
    with pytest.raises(ValueError, match="generation_config"):
        LLM(generation_config="/nowhere")


@pytest.fixture(scope="module")
def ll_tokenizer(llm) -> llguidance.LLTokenizer:
    tok = llm.engine.tokenizer
    return llguidance.LLTokenizer(tok.to_json_str(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids))


def _constraint(**body: Any) -> str:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
    params = build_structured_outputs(req)
    assert params is not None
    return grammar_text(params).grammar


def _accepts(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar lets the model write `text` (as a prefix of a valid output)."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    ids = tokenizer.tokenize_str(text)
    return matcher.validate_tokens(ids) == len(ids) and not matcher.is_error()


def test_strict_schema_allows_no_unlisted_properties(ll_tokenizer):
    strict = _constraint(response_format={"type": "json_schema",
                                          "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}})
    assert _accepts(ll_tokenizer, strict, '{"a": 1}')
    assert not _accepts(ll_tokenizer, strict, '{"a": 1, "b"')
    nested = _constraint(guided_json={"type": "object", "properties": {"p": SCHEMA}})
    assert not _accepts(ll_tokenizer, nested, '{"p": {"a": 1, "b"')
    # Saying so keeps extra properties: in the schema, or with disable_additional_properties false.
    open_schema = _constraint(guided_json={**SCHEMA, "additionalProperties": True})
    assert _accepts(ll_tokenizer, open_schema, '{"a": 1, "b"')
    opted = _constraint(structured_outputs={"json": SCHEMA, "disable_additional_properties": False})
    assert _accepts(ll_tokenizer, opted, '{"a": 1, "b"')


def test_whitespace_options(ll_tokenizer):
    default = _constraint(structured_outputs={"json": SCHEMA})
    assert _accepts(ll_tokenizer, default, '{"a": 1}') and not _accepts(ll_tokenizer, default, '{ "a"')
    same = _constraint(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True})
    assert same == default
    free = _constraint(structured_outputs={"json": SCHEMA, "disable_any_whitespace": False})
    assert _accepts(ll_tokenizer, free, '{\n  "a" : 1\n}') and _accepts(ll_tokenizer, free, '{"a":1}')
    pattern = _constraint(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
                          structured_outputs={"whitespace_pattern": "[ ]?"})
    assert _accepts(ll_tokenizer, pattern, '{ "a" : 1 }') and not _accepts(ll_tokenizer, pattern, '{\n')
    legacy = _constraint(guided_json=SCHEMA, guided_whitespace_pattern="[ ]?")
    assert legacy == pattern
    with pytest.raises(InvalidArgumentError) as info:
        _constraint(structured_outputs={"regex": "a+", "whitespace_pattern": " "})
    assert info.value.param == "structured_outputs"


def test_structural_tag(ll_tokenizer):
    tag = {"structures": [{"begin": "<function=get>", "schema": {"type": "object",
                                                                  "properties": {"city": {"type": "string"}}},
                           "end": "</function>"}],
           "triggers": ["<function="]}
    for grammar in (_constraint(structured_outputs={"structural_tag": tag}),
                    _constraint(response_format={"type": "structural_tag", **tag})):
        assert _accepts(ll_tokenizer, grammar, 'Let me look. <function=get>{"city": "Paris"}</function> Done.')
        assert not _accepts(ll_tokenizer, grammar, 'Let me look. <function=get>{"city": 3')
        assert not _accepts(ll_tokenizer, grammar, '<function=get>{"city": "Paris", "x"')
    with pytest.raises(InvalidArgumentError) as info:
        _constraint(response_format={"type": "structural_tag", "format": {"type": "triggered_tags"}})
    assert info.value.param == "response_format"


def test_offline_params_take_vllms_options(llm, ll_tokenizer):
    """StructuredOutputsParams' own option fields (vLLM's offline spelling) mean what the request fields do:
    the same grammar as the server's hook builds, and refusals naming the option."""
    from ferrox import SamplingParams
    from ferrox.structured.params import StructuredOutputsParams as Params

    tag = {"structures": [{"begin": "<f>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f>"]}
    for body, params in (
        ({"json": SCHEMA, "disable_any_whitespace": False}, Params(json=SCHEMA, disable_any_whitespace=False)),
        ({"json": SCHEMA, "disable_additional_properties": False},
         Params(json=SCHEMA, disable_additional_properties=False)),
        ({"json": SCHEMA, "whitespace_pattern": "[ ]?"}, Params(json=SCHEMA, whitespace_pattern="[ ]?")),
        ({"json": SCHEMA, "disable_any_whitespace": True}, Params(json=SCHEMA, disable_any_whitespace=True)),
        ({"json_object": True, "disable_any_whitespace": False},
         Params(json_object=True, disable_any_whitespace=False)),
        ({"structural_tag": tag}, Params(structural_tag=tag)),
        ({"structural_tag": tag, "disable_any_whitespace": False},
         Params(structural_tag=json.dumps(tag), disable_any_whitespace=False)),  # vLLM's JSON-text form too
    ):
        assert grammar_text(params).grammar == _constraint(structured_outputs=body), body
    assert grammar_text(Params(json=SCHEMA, disable_fallback=True)).grammar == _constraint(structured_outputs={
        "json": SCHEMA})
    for kwargs, name in ((dict(regex="a+", disable_any_whitespace=False), "disable_any_whitespace"),
                         (dict(choice=["a"], disable_additional_properties=True), "disable_additional_properties"),
                         (dict(json=SCHEMA, disable_any_whitespace="no"), "disable_any_whitespace")):
        with pytest.raises(ValueError, match=f"structured_outputs.{name}"):
            Params(**kwargs)
    # End to end: the offline engine writes JSON in the free layout it was allowed.
    free = SamplingParams(temperature=0, max_tokens=24,
                          structured_outputs=Params(json=SCHEMA, disable_any_whitespace=False))
    text = llm.generate(["Give me a JSON object with a number a."], free, use_tqdm=False)[0].outputs[0].text
    assert _accepts(ll_tokenizer, grammar_text(Params(json=SCHEMA, disable_any_whitespace=False)).grammar, text)


def test_structured_outputs_config_sets_request_defaults():
    """vLLM's engine-level structured_outputs_config: its JSON options are the default of requests that leave
    them unset (a request's own value wins); other backends and unknown keys are refused by name."""
    from ferrox.config import EngineConfig
    from ferrox.structured.params import StructuredOutputsParams as Params
    from ferrox.structured_outputs_config import parse_structured_outputs_config, with_defaults

    defaults = parse_structured_outputs_config({"backend": "guidance", "disable_any_whitespace": False,
                                                "disable_additional_properties": False, "disable_fallback": True})
    free = with_defaults(Params(json=SCHEMA), defaults)
    assert (free.disable_any_whitespace, free.disable_additional_properties) == (False, False)
    assert with_defaults(Params(json=SCHEMA, disable_any_whitespace=True), defaults).disable_any_whitespace is True
    assert with_defaults(Params(json=SCHEMA, whitespace_pattern=" ?"), defaults).disable_any_whitespace is None
    assert with_defaults(Params(regex="a+"), defaults) == Params(regex="a+")  # not JSON: untouched
    for value, key in (({"backend": "xgrammar"}, "backend"), ({"backend": "magic"}, "backend"),
                       ({"guided": 1}, "guided"), ({"enable_in_reasoning": "yes"}, "enable_in_reasoning"),
                       ({"reasoning_parser_plugin": 5}, "reasoning_parser_plugin"),
                       ({"reasoning_parser": "qwen3", "backend": "auto"}, None)):
        if key is None:
            assert EngineConfig(structured_outputs_config=value).reasoning_parser == "qwen3"
            continue
        with pytest.raises(ValueError, match=f"structured_outputs_config.{key}"):
            EngineConfig(structured_outputs_config=value)
    with pytest.raises(ValueError, match="structured_outputs_config.reasoning_parser"):
        EngineConfig(structured_outputs_config={"reasoning_parser": "qwen3"}, reasoning_parser="deepseek_r1")
    with pytest.raises(ValueError, match="--reasoning-parser-plugin /x.py: no such file"):  # (run as the flag's)
        EngineConfig(structured_outputs_config={"reasoning_parser_plugin": "/x.py"})


def test_structured_outputs_config_defaults_reach_the_engine(tmp_path):
    """End to end on a tiny model: with disable_any_whitespace false server-wide, a JSON request without the
    option may write free whitespace (its matcher accepts it), where the default layout does not."""
    from ferrox import SamplingParams
    from ferrox.structured.params import StructuredOutputsParams as Params

    from tests.helpers.tiny_models import make_tiny_llama

    model = make_tiny_llama(tmp_path / "m")
    llm = LLM(model, device="cpu", kv_cache_memory=16 << 20,
              structured_outputs_config={"disable_any_whitespace": False})
    manager = llm.engine._structured()
    seen = []
    real = manager.submit
    manager.submit = lambda rid, params, **kw: seen.append(params) or real(rid, params, **kw)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, structured_outputs=Params(
        json=SCHEMA)), use_tqdm=False)
    assert seen[0].disable_any_whitespace is False
