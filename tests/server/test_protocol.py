"""Request validation and field mapping, without a server (fast)."""

from __future__ import annotations

import argparse

import pytest
from ferrox.entrypoints.anthropic.protocol import MessagesRequest
from ferrox.entrypoints.cli import parse_size
from ferrox.entrypoints.openai.errors import from_exception, from_validation_error
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from ferrox.entrypoints.openai.structured import build_structured_outputs
from ferrox.entrypoints.openai.tools import validate_tools
from ferrox.errors import InvalidArgumentError
from pydantic import ValidationError

MSG = [{"role": "user", "content": "hi"}]


def test_chat_message_content_parts():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi", "name": "bob"},
    ]})
    assert req.messages[0].text() == "be \nbrief"  # vLLM's joiner
    assert req.messages[0].to_template_dict() == {"role": "system", "content": [
        {"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]}  # rendering shapes them
    assert req.messages[1].to_template_dict() == {"role": "user", "content": "hi", "name": "bob"}


def test_max_completion_tokens_wins():
    req = ChatCompletionRequest.model_validate({"messages": MSG, "max_tokens": 5, "max_completion_tokens": 7})
    assert req.requested_max_tokens == 7


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MSG, "temperature": "x"}, "temperature"),
        ({"messages": MSG, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"messages": MSG, "logit_bias": {"5": 101}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
        ({"messages": MSG, "top_logprobs": 2}, None),  # needs logprobs=true (a whole-body rule)
    ],
)
def test_validation_errors_name_the_field(body, param):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    err = from_validation_error(info.value)
    assert err.status == 400 and err.param == param


def test_completion_prompt_forms():
    assert CompletionRequest.model_validate({"prompt": "a"}).prompts() == ["a"]
    assert CompletionRequest.model_validate({"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert CompletionRequest.model_validate({"prompt": [[1], [2, 3]]}).prompts() == [[1], [2, 3]]
    assert CompletionRequest.model_validate({"prompt": ["a", "b"]}).prompts() == ["a", "b"]
    for bad in ([], {"x": 1}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": bad})
    # Only the shape is checked here: an empty token-id prompt or an id outside the vocabulary is
    # the engine's request rules' to refuse (tests/server/test_errors.py).
    assert CompletionRequest.model_validate({"prompt": [[1], []]}).prompts() == [[1], []]
    assert CompletionRequest.model_validate({"prompt": [-1]}).prompts() == [[-1]]


def test_structured_output_spellings():
    def build(**fields):
        return build_structured_outputs(ChatCompletionRequest.model_validate({"messages": MSG, **fields}))

    assert build() is None
    assert build(response_format={"type": "text"}) is None
    assert build(response_format={"type": "json_object"}).json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert build(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}).json == schema
    assert build(structured_outputs={"regex": "[0-9]+"}).regex == "[0-9]+"
    assert build(guided_choice=["yes", "no"]).choice == ["yes", "no"]
    assert build(guided_json=schema).json == schema
    assert build(guided_grammar='start: "a"').grammar == 'start: "a"'
    for fields, param in (
        ({"guided_json": schema, "guided_regex": "a"}, "guided_regex"),  # only one constraint
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),  # unknown key
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "("}, "guided_regex"),  # llguidance refuses it
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ):
        with pytest.raises(InvalidArgumentError, match=f"^{param}:") as info:
            build(**fields)
        assert info.value.param == param


def test_tool_choice_validation():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]

    def check(**fields):
        validate_tools(ChatCompletionRequest.model_validate({"messages": MSG, **fields}))

    check(tools=tools, tool_choice="auto")
    check(tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for bad in ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                {"tool_choice": "required"}):
        with pytest.raises(InvalidArgumentError, match="^tool_choice") as info:
            check(**bad)
        assert info.value.param == "tool_choice"
    with pytest.raises(InvalidArgumentError, match=r"^tools\[0\]") as info:
        check(tools=[{"type": "retrieval"}])
    assert info.value.param == "tools"


def test_exception_param():
    """The API error's param is the exception's `param` (renamed for the route), never parsed from
    the message; an error naming no field gets the route's default."""
    from ferrox.errors import EngineDeadError, InvalidArgumentError, PromptTooLongError

    err = from_exception(InvalidArgumentError("top_k: must be >= 0, got -5", param="top_k"))
    assert (err.status, err.param, err.code) == (400, "top_k", "invalid_value")
    assert from_exception(ValueError("top_k: looks like a field"), default_param="messages").param == "messages"
    long = from_exception(PromptTooLongError("prompt: too long", param="prompt"), rename={"prompt": "messages"})
    assert (long.status, long.param, long.code) == (400, "messages", "context_length_exceeded")
    assert from_exception(EngineDeadError("gone")).status == 503


def test_anthropic_request():
    req = MessagesRequest.model_validate({
        "max_tokens": 5, "system": [{"type": "text", "text": "sys"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    })
    assert req.template_messages() == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({"max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({"messages": MSG})  # max_tokens is required


def test_parse_size():
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1000") == 1000
    assert parse_size("1.5GB") == 1_500_000_000
    for bad in ("lots", "-1", "0", "5 parsecs"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_every_route_takes_the_models_sampling_defaults():
    """The model's generation_config sampling defaults (temperature, top_p, top_k, min_p,
    repetition_penalty) fill what a request leaves unset on /v1/messages and /v1/responses as on chat,
    including knobs those APIs have no field for; a request's own value wins."""
    import types

    from ferrox.entrypoints.anthropic import serving_messages
    from ferrox.entrypoints.anthropic.protocol import MessagesRequest
    from ferrox.entrypoints.openai import serving_responses
    from ferrox.entrypoints.openai.protocol_responses import ResponsesRequest
    from ferrox.entrypoints.openai.serving import sampling_knobs

    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                "max_new_tokens": 99, "top_k_bad": "x"}
    ctx = types.SimpleNamespace(engine=types.SimpleNamespace(generation_defaults=defaults))
    msg = serving_messages._sampling_params(ctx, MessagesRequest.model_validate(
        {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.3}), None)
    assert (msg.temperature, msg.top_p, msg.top_k, msg.min_p, msg.repetition_penalty) == (0.3, 0.95, 20, 0.05, 1.1)
    resp = serving_responses._sampling_params(ctx, ResponsesRequest.model_validate({"input": "hi", "top_p": 0.5}),
                                              None)
    assert (resp.temperature, resp.top_p, resp.top_k, resp.min_p, resp.repetition_penalty) == (0.6, 0.5, 20, 0.05, 1.1)
    assert sampling_knobs({"top_k": "20"}, temperature=None) == {}  # a malformed default is skipped
