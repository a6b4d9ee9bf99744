"""Sleep mode on a CUDA GPU (skipped without one): LLM.sleep gives the weights' and the KV cache's
device memory back, wake_up takes it again at the same addresses, so the captured CUDA graphs replay
and the greedy tokens are those of before; a second engine in the process is not touched."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = ["hello world", "the cat sat on", "one two three"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("llama")), hidden_size=256, num_layers=4)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_sleep_frees_device_memory_and_wake_up_restores_the_model(tiny_llama):
    kv_bytes = 2 << 30
    llm = LLM(tiny_llama, device="cuda", enable_sleep_mode=True, kv_cache_memory=kv_bytes, max_num_seqs=8)
    other = LLM(tiny_llama, device="cuda", kv_cache_memory=64 << 20, max_num_seqs=8)  # no sleep mode
    assert llm.engine.runner.graph_runner is not None  # decode steps replay CUDA graphs
    before = _tokens(llm)
    free_awake = torch.cuda.mem_get_info()[0]
    llm.sleep(level=1)
    freed = torch.cuda.mem_get_info()[0] - free_awake
    assert llm.is_sleeping()
    assert freed >= 0.95 * kv_bytes, f"sleep freed {freed / 2**30:.2f} GiB"
    assert _tokens(other) == before  # the other engine's memory is its own
    llm.wake_up()
    assert not llm.is_sleeping()
    assert _tokens(llm) == before
    # The KV cache alone, twice over: the same memory mapped again each time.
    for _ in range(2):
        llm.sleep(tags=["kv_cache"])
        llm.wake_up(tags=["kv_cache"])
        assert _tokens(llm) == before


def test_sleep_under_fp8_kv_cache(tiny_llama):
    llm = LLM(tiny_llama, device="cuda", enable_sleep_mode=True, kv_cache_dtype="fp8", kv_cache_memory=256 << 20)
    before = _tokens(llm)
    llm.sleep(level=1)
    llm.wake_up()
    assert _tokens(llm) == before


def test_level_2_and_reload_weights_in_place(tiny_llama):
    """Level 2 discards the weights' GPU memory with the KV cache (no host copy); reload_weights reads the
    checkpoint into the same addresses, so the captured CUDA graphs replay with the right weights."""
    llm = LLM(tiny_llama, device="cuda", enable_sleep_mode=True, kv_cache_memory=256 << 20, max_num_seqs=8)
    before = _tokens(llm)
    weights = llm.engine.sleeper.memory.weights
    pointers = [t.data_ptr() for t in weights]
    llm.sleep(level=2)
    assert llm.engine.stats()["discard_all"] is True
    llm.wake_up(tags=["weights"])
    assert llm.collective_rpc("reload_weights") == [None]
    llm.wake_up(tags=["kv_cache"])
    assert [t.data_ptr() for t in weights] == pointers
    assert _tokens(llm) == before
