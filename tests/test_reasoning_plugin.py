"""--reasoning-parser-plugin (vLLM's; ferrox/reasoning/plugin.py): a file that registers marker families whose
names --reasoning-parser then takes, in the API server and in the engine core.

- the plugin's family splits thinking from the answer as the built-in families do, whole and streamed;
- built-in names, malformed families, missing or failing files are refused naming the flag (or the call);
- `structured_outputs_config.reasoning_parser_plugin` is the same setting;
- a live server with the plugin answers chat requests and refuses what its text markers cannot give
  (thinking_token_budget) by name -- so both processes know the parser.
"""

from __future__ import annotations

import os

import pytest
from ferrox.config import EngineConfig
from ferrox.reasoning import get_reasoning_parser
from ferrox.reasoning.families import Family
from ferrox.reasoning.plugin import load_reasoning_parser_plugin, register_reasoning_parser

PLUGIN = os.path.join(os.path.dirname(__file__), "helpers", "reasoning_plugin.py")


def test_plugin_family_splits_thinking_whole_and_streamed():
    load_reasoning_parser_plugin(PLUGIN)
    parser = get_reasoning_parser("test_markers", lambda tag: None)
    text = "THINK: two and two ANSWER: four"
    assert parser.split(text) == (" two and two ", " four")
    assert parser.split("just an answer") == (None, "just an answer")
    stream = parser.stream()
    pieces = [stream.feed(text[i:i + 3]) for i in range(0, len(text), 3)] + [stream.feed("", finished=True)]
    assert "".join(r for r, _ in pieces) == " two and two " and "".join(c for _, c in pieces) == " four"
    assert EngineConfig(reasoning_parser_plugin=PLUGIN, reasoning_parser="test_markers").reasoning_parser \
        == "test_markers"
    config = EngineConfig(structured_outputs_config={"reasoning_parser_plugin": PLUGIN,
                                                     "reasoning_parser": "test_markers"})
    assert config.reasoning_parser_plugin == PLUGIN


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="'qwen3' is one of ferrox's own parsers"):
        register_reasoning_parser("qwen3", Family(("<a>",), ("</a>",), untagged="reasoning"))
    with pytest.raises(ValueError, match="untagged"):
        register_reasoning_parser("bad", Family(("<a>",), ("</a>",), untagged="maybe"))
    with pytest.raises(ValueError, match="give a ferrox.reasoning.families.Family"):
        register_reasoning_parser("bad", object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--reasoning-parser-plugin .*nope.py: no such file"):
        load_reasoning_parser_plugin(str(tmp_path / "nope.py"))
    vllm_style = tmp_path / "vllm_style.py"
    vllm_style.write_text("from vllm.reasoning import ReasoningParser\n")
    with pytest.raises(ValueError, match="loading it failed: ModuleNotFoundError"):
        load_reasoning_parser_plugin(str(vllm_style))
    with pytest.raises(ValueError, match="reasoning_parser: 'not_registered' is not one of"):
        EngineConfig(reasoning_parser="not_registered")
    with pytest.raises(ValueError, match="differs from reasoning_parser_plugin"):
        EngineConfig(reasoning_parser_plugin=PLUGIN, structured_outputs_config={"reasoning_parser_plugin": "x.py"})


@pytest.mark.slow
def test_server_loads_the_plugin_in_both_processes():
    from tests.server.server_proc import ServerProcess, post_json

    srv = ServerProcess("--reasoning-parser-plugin", PLUGIN, "--reasoning-parser", "test_markers",
                        "--max-model-len", "512", "--kv-cache-memory", "64MiB")
    try:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        status, reply = post_json(srv.base_url, body)
        assert status == 200 and reply["choices"][0]["message"]["content"] is not None, reply
        status, reply = post_json(srv.base_url, {**body, "thinking_token_budget": 8})
        assert status == 400 and "test_markers" in reply["error"]["message"], reply
        assert reply["error"]["param"] == "thinking_token_budget"
    finally:
        assert srv.stop() == 0
