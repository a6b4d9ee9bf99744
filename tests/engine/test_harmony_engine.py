"""The engine core's side of --reasoning-parser openai_gptoss (offline LLM, real Rust core, a tiny random
Llama with a harmony tokenizer): gpt-oss's thinking ends with several tokens, so the one-token grammar
gate and thinking budget are refused by name; a tokenizer without harmony's markers is refused at start."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError
from ferrox.structured.params import StructuredOutputsParams

from tests.helpers.harmony_tokenizer import make_tiny_harmony_llama
from tests.helpers.tiny_models import make_tiny_llama

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = make_tiny_harmony_llama(tmp_path_factory.mktemp("harmony") / "model")
    return LLM(folder, reasoning_parser="openai_gptoss", max_model_len=256, kv_cache_memory=16 << 20)


def test_generates_under_the_parser(llm):
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize(("params", "field"), [
    (SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
     "structured_outputs"),
    (SamplingParams(max_tokens=4, thinking_token_budget=2), "thinking_token_budget"),
])
def test_one_token_gates_refused(llm, params, field):
    with pytest.raises(InvalidArgumentError, match=f"{field}: not supported with reasoning_parser 'openai_gptoss'") as err:
        llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert err.value.param == field


def test_tokenizer_without_harmony_refused(tmp_path):
    folder = make_tiny_llama(tmp_path / "plain")
    with pytest.raises(ValueError, match="reasoning_parser: 'openai_gptoss' needs"):
        LLM(folder, reasoning_parser="openai_gptoss", max_model_len=256, kv_cache_memory=16 << 20)
