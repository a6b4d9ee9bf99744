"""The engine core's side of reasoning parsers whose thinking does not end at one token (offline LLM, real
Rust core, tiny random Llamas): openai_gptoss (gpt-oss's harmony ends with several tokens; a tokenizer with
harmony's markers) and granite (text markers; any tokenizer). The one-token grammar gate and thinking budget
are refused by name under both; a tokenizer without a parser's markers is refused at start (harmony's,
Magistral's [THINK] tokens); the async engine refuses before the core, naming the parser."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError
from ferrox.structured.params import StructuredOutputsParams

from tests.helpers.harmony_tokenizer import make_tiny_harmony_llama
from tests.helpers.tiny_models import make_tiny_llama

PROMPT = [5, 6, 7, 8, 9, 10]
FOLDERS = {"openai_gptoss": make_tiny_harmony_llama, "granite": make_tiny_llama}


@pytest.fixture(scope="module", params=list(FOLDERS))
def llm(request, tmp_path_factory):
    """(parser, an LLM running under it)."""
    parser = request.param
    folder = FOLDERS[parser](tmp_path_factory.mktemp(parser) / "model")
    return parser, LLM(folder, reasoning_parser=parser, max_model_len=256, kv_cache_memory=16 << 20)


def test_generates_under_the_parser(llm):
    _, engine = llm
    out = engine.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=6, temperature=0.0),
                          use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize(("params", "field"), [
    (SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
     "structured_outputs"),
    (SamplingParams(max_tokens=4, thinking_token_budget=2), "thinking_token_budget"),
])
def test_one_token_gates_refused(llm, params, field):
    parser, engine = llm
    with pytest.raises(InvalidArgumentError, match=f"{field}: not supported with reasoning_parser '{parser}'") as err:
        engine.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert err.value.param == field


def test_tokenizer_without_harmony_refused(tmp_path):
    folder = make_tiny_llama(tmp_path / "plain")
    with pytest.raises(ValueError, match="reasoning_parser: 'openai_gptoss' needs"):
        LLM(folder, reasoning_parser="openai_gptoss", max_model_len=256, kv_cache_memory=16 << 20)


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
