"""The engine core's side of --reasoning-parser granite (offline LLM, real Rust core, a tiny random Llama):
Granite's markers are text, so the one-token grammar gate and thinking budget are refused by name, and any
tokenizer is taken (there are no tag tokens to look up)."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError
from ferrox.structured.params import StructuredOutputsParams

from tests.helpers.tiny_models import make_tiny_llama

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("granite") / "model")
    return LLM(folder, reasoning_parser="granite", max_model_len=256, kv_cache_memory=16 << 20)


def test_generates_under_the_parser(llm):
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize(("params", "field"), [
    (SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
     "structured_outputs"),
    (SamplingParams(max_tokens=4, thinking_token_budget=2), "thinking_token_budget"),
])
def test_one_token_gates_refused(llm, params, field):
    with pytest.raises(InvalidArgumentError, match=f"{field}: not supported with reasoning_parser 'granite'") as err:
        llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert err.value.param == field


def test_mistral_tokenizer_without_think_tokens_refused(tmp_path):
    folder = make_tiny_llama(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"reasoning_parser: 'mistral' needs \[THINK\] and \[/THINK\]"):
        LLM(folder, reasoning_parser="mistral", max_model_len=256, kv_cache_memory=16 << 20)


def test_async_engine_refuses_by_name_before_the_core(tmp_path):
    """The async engine checks requests before they cross to the core process, against the parser's own end
    of thinking (not a `</think>` lookup): under granite a budget is refused naming the parser, not as a
    request "needing a reasoning parser"."""
    import asyncio

    from ferrox import AsyncLLM

    engine = AsyncLLM(model=make_tiny_llama(tmp_path / "model"), reasoning_parser="granite", max_model_len=256,
                      kv_cache_memory=16 << 20)

    async def run():
        with pytest.raises(InvalidArgumentError, match="thinking_token_budget: not supported with reasoning_parser "
                                                       "'granite'"):
            async for _ in engine.generate({"prompt_token_ids": PROMPT},
                                           SamplingParams(max_tokens=4, thinking_token_budget=2), "budget"):
                pass
        return [o async for o in engine.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=3), "ok")]

    try:
        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert outs[-1].finished
