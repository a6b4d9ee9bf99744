"""Sleep mode on the CPU engine (the embedded model, the real Rust core): sleep drops the KV cache's
memory and stops scheduling, wake_up brings both back with the same greedy tokens; requests in flight
are aborted, refused ("wait" with requests left) or kept and recomputed ("keep"), under async
scheduling too. GPU memory: tests/engine/test_gpu_sleep.py; the server's routes:
tests/server/test_sleep_server.py."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams
from ferrox.engine.protocol import EngineCoreRequest
from ferrox.errors import InvalidArgumentError
from ferrox.sampling_params import RequestOutputKind

from tests.engine.test_batch_invariance import assert_no_leaked_blocks

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def sleepy():
    return LLM(dtype="float32", enable_sleep_mode=True, kv_cache_memory=64 << 20, max_model_len=1024,
               async_scheduling=True)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _kv_bytes(llm: LLM) -> int:
    return sum(kv.untyped_storage().nbytes() for kv in llm.engine.sleeper.memory.kv_caches)


def test_sleep_drops_the_kv_cache_and_wake_up_restores_the_engine(sleepy):
    before = _tokens(sleepy)
    full = _kv_bytes(sleepy)
    sleepy.sleep(level=1)
    assert sleepy.is_sleeping() and _kv_bytes(sleepy) == 0
    with pytest.raises(RuntimeError, match="wake_up"):
        sleepy.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    sleepy.wake_up(tags=["weights"])
    assert sleepy.is_sleeping(), "asleep until every released tag is awake"
    sleepy.wake_up()
    assert not sleepy.is_sleeping() and _kv_bytes(sleepy) == full
    assert _tokens(sleepy) == before
    # Level 0 pauses without releasing; tags=["kv_cache"] releases the cache alone.
    sleepy.sleep(level=0)
    assert sleepy.is_sleeping() and _kv_bytes(sleepy) == full
    sleepy.wake_up()
    sleepy.sleep(tags=["kv_cache"])
    assert _kv_bytes(sleepy) == 0
    sleepy.wake_up(tags=["kv_cache"])
    assert not sleepy.is_sleeping() and _tokens(sleepy) == before
    assert_no_leaked_blocks(sleepy)


def _start(llm: LLM, tag: str) -> list[str]:
    ids = []
    for i, prompt in enumerate(PROMPTS):
        rid = f"{tag}-{i}"
        request = EngineCoreRequest(rid, llm.get_tokenizer().encode(prompt),
                                    GREEDY.clone(output_kind=RequestOutputKind.FINAL_ONLY))
        for r in llm.output_processor.add_request(request, prompt):
            llm.engine.add_request(r)
        ids.append(rid)
    return ids


def _run(llm: LLM, steps: int | None = None) -> dict:
    finals = {}
    n = 0
    while llm.engine.has_unfinished_requests() and (steps is None or n < steps):
        for ro in llm.output_processor.process_outputs(llm.engine.step()):
            if ro.finished:
                finals[ro.request_id] = ro
        n += 1
        assert n < 500
    return finals


def test_keep_recomputes_requests_after_the_wake_up_and_abort_ends_them(sleepy):
    expected = _tokens(sleepy)
    engine = sleepy.engine
    ids = _start(sleepy, "keep")
    _run(sleepy, steps=6)  # prefill and a few decodes, a step in flight (async scheduling)
    with pytest.raises(InvalidArgumentError) as err:
        engine.sleep(mode="wait")  # (the core process waits for them first; the engine refuses)
    assert err.value.param == "mode"
    sleepy.output_processor.process_outputs(engine.sleep(mode="keep"))
    assert engine.stats()["num_running"] == 0 and engine.stats()["num_waiting"] == len(ids)
    assert len(engine.step()) == 0 and engine.has_unfinished_requests()  # asleep: nothing runs
    engine.wake_up()
    finals = _run(sleepy)
    assert [finals[rid].outputs[0].token_ids for rid in ids] == expected

    ids = _start(sleepy, "abort")
    _run(sleepy, steps=4)
    aborted = {ro.request_id: ro for ro in sleepy.output_processor.process_outputs(engine.sleep(level=1))}
    assert sorted(aborted) == sorted(ids)
    assert all(ro.finished and ro.outputs[0].finish_reason == "abort" for ro in aborted.values())
    assert not engine.has_unfinished_requests()
    engine.wake_up()
    assert _tokens(sleepy) == expected
    assert_no_leaked_blocks(sleepy)


def test_level_2_discards_the_weights_until_reload_weights(sleepy):
    """vLLM's level-2 flow: sleep(level=2), wake_up(tags=["weights"]), collective_rpc("reload_weights"),
    wake_up(tags=["kv_cache"]); the weights' memory is gone in between (here host memory: the CPU path) and
    nothing runs until the reload."""
    before = _tokens(sleepy)
    weights = sleepy.engine.sleeper.memory.weights
    full = sum(t.untyped_storage().nbytes() for t in weights)
    sleepy.sleep(level=2)
    assert sum(t.untyped_storage().nbytes() for t in weights) == 0 and _kv_bytes(sleepy) == 0
    assert sleepy.engine.stats()["discard_all"] is True
    with pytest.raises(InvalidArgumentError):
        sleepy.collective_rpc("reload_weights", args=(1,))  # (no arguments)
    sleepy.wake_up(tags=["weights"])
    with pytest.raises(RuntimeError, match="reload_weights"):
        sleepy.generate(PROMPTS[0], GREEDY, use_tqdm=False)  # awake weights, but discarded: garbage until reload
    assert sleepy.collective_rpc("reload_weights") == [None]
    assert sum(t.untyped_storage().nbytes() for t in weights) == full
    assert sleepy.is_sleeping() and sleepy.engine.paused  # the KV cache still sleeps
    sleepy.wake_up(tags=["kv_cache"])
    assert not sleepy.is_sleeping() and _tokens(sleepy) == before
    # Sleeping the weights by tag discards them too.
    sleepy.sleep(tags=["weights"])
    sleepy.wake_up()
    assert sleepy.engine.paused and not sleepy.is_sleeping()
    sleepy.collective_rpc("reload_weights")
    assert not sleepy.engine.paused and _tokens(sleepy) == before
    assert_no_leaked_blocks(sleepy)


def test_sleep_arguments_are_checked_by_name(sleepy, llm):
    with pytest.raises(InvalidArgumentError) as err:
        llm.sleep()  # started without enable_sleep_mode
    assert err.value.param == "enable_sleep_mode"
    with pytest.raises(InvalidArgumentError) as err:
        llm.collective_rpc("reload_weights")  # the weights are not kept reloadable without it
    assert err.value.param == "method"
    with pytest.raises(InvalidArgumentError) as err:
        sleepy.collective_rpc("init_device")  # a vLLM worker method ferrox lacks
    assert err.value.param == "method"
    for kwargs, param in ((dict(level=3), "level"), (dict(level=True), "level"), (dict(mode="later"), "mode"),
                          (dict(tags=["gpu"]), "tags")):
        with pytest.raises(InvalidArgumentError) as err:
            sleepy.sleep(**kwargs)
        assert err.value.param == param, kwargs
    with pytest.raises(InvalidArgumentError) as err:
        sleepy.wake_up(tags=["gpu"])
    assert err.value.param == "tags"
    assert not sleepy.is_sleeping()


def test_a_quantized_gguf_on_cpu_keeps_its_weights(sleepy):
    """The default CPU engine keeps the GGUF's blocks packed in Rust objects: no tensors to discard or read
    again, so level 2, the weights tag and reload_weights are refused by name; level 1 works."""
    quantized = LLM(enable_sleep_mode=True, kv_cache_memory=32 << 20, max_model_len=512)
    for kwargs, param in ((dict(level=2), "level"), (dict(tags=["weights"]), "tags")):
        with pytest.raises(InvalidArgumentError) as err:
            quantized.sleep(**kwargs)
        assert err.value.param == param
    with pytest.raises(InvalidArgumentError) as err:
        quantized.collective_rpc("reload_weights")
    assert err.value.param == "method"
    before = quantized.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    quantized.sleep(level=1)
    quantized.wake_up()
    assert quantized.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == before


def test_lora_engines_keep_their_weights_and_offline_rpc_takes_no_timeout(sleepy):
    """LoRA wraps the layers after loading, so a reload could not line up: discarding the weights is refused
    before anything sleeps (level 1 remains). The offline collective_rpc cannot bound its call: timeout is
    refused by name."""
    with_lora = LLM(dtype="float32", enable_sleep_mode=True, enable_lora=True, kv_cache_memory=32 << 20,
                    max_model_len=512)
    with pytest.raises(InvalidArgumentError) as err:
        with_lora.sleep(level=2)
    assert err.value.param == "level" and not with_lora.is_sleeping()
    with pytest.raises(InvalidArgumentError) as err:
        sleepy.collective_rpc("reload_weights", timeout=5.0)
    assert err.value.param == "timeout"
