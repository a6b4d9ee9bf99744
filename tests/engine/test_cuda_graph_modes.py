"""vLLM's cudagraph_mode and capture sizes on a CUDA GPU (skipped without one; the settings' parsing is
tests/test_compilation_config.py): each mode captures what it names at the sizes asked for, steps past
them run eagerly, and every mode generates the CPU's greedy tokens (float32)."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = ["hello world", "the cat sat on", "one two three", "a b c d e f g", "tiny model says"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("llama")), hidden_size=128, num_layers=2)


@pytest.fixture(scope="module")
def cpu_tokens(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = LLM(tiny_llama, device="cpu", kv_cache_memory=32 << 20).generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kwargs,decode,pieces", [
    (dict(), [1, 2, 4, 8], [8, 16, 32, 48, 64]),
    (dict(compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}, cudagraph_capture_sizes=[1, 2]), [1, 2], []),
    (dict(compilation_config={"cudagraph_mode": "PIECEWISE", "max_cudagraph_capture_size": 16}), [], [8, 16]),
    # piecewise graphs not of one token (ferrox's one-token path has no attention call to cut around):
    # such a step pads to 4
    (dict(cudagraph_capture_sizes=[1, 4, 32]), [1, 4], [4, 32]),
    (dict(max_cudagraph_capture_size=4), [1, 2, 4], [4]),
    (dict(compilation_config={"mode": 0}), [], []),  # vLLM: no piecewise compilation, no graphs
    (dict(compilation_config={"cudagraph_mode": "NONE"}), [], []),
], ids=["default", "full-decode-only", "piecewise", "sizes", "max", "mode-0", "none"])
def test_modes_capture_what_they_name(tiny_llama, cpu_tokens, kwargs, decode, pieces):
    llm = LLM(tiny_llama, device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
              kv_cache_memory=64 << 20, **kwargs)
    forward = llm.engine.runner.forward
    assert forward.decode_graph_sizes() == decode
    assert forward.piecewise_graph_sizes() == pieces
    # 5 prompts: decode batches of 5 and fewer (past 2 or 4 eager where those are the graphs' top)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == cpu_tokens


def test_capture_sizes_reach_verify_and_draft_graphs(tiny_llama, cpu_tokens):
    """With a draft model, the target's verify graphs and the draft's own graphs take the decode sizes too;
    larger batches (5 prompts) verify and draft eagerly, with the same greedy tokens."""
    llm = LLM(tiny_llama, device="cuda", dtype="float32", max_num_seqs=8, kv_cache_memory=64 << 20,
              cudagraph_capture_sizes=[1, 2], speculative_config={"method": "draft_model", "model": tiny_llama,
                                                                  "num_speculative_tokens": 3})
    assert llm.engine.runner.graph_runner.batch_sizes == [1, 2]
    assert llm.engine.runner.graph_runner.verify_sizes == [1, 2]
    assert llm.engine.drafter is not None and llm.engine.drafter.graphs.batch_sizes == [1, 2]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == cpu_tokens
    one = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert one[0].outputs[0].token_ids == cpu_tokens[0]  # batch 1: the graphs
