"""--logits-processors (vLLM's custom logits processors, ferrox/logits_processor.py) through the engine.

- the batch updates (worker/custom_logits.py) carry a processor's per-row state from any step's rows to
  any next step's, over random churn, inside rows below the larger batch;
- a tiny Llama with three processors, a dozen requests through a 3-request batch, 8-token prefill chunks
  and a KV cache small enough to preempt: each forced request gives exactly its token, each counting
  request counts up from its start (its output list current at every step), each echoing request repeats
  its prompt, and the free requests give what an engine without processors gives;
- loading by class path (both spellings) or class; what is not a processor, or not importable, is refused
  naming logits_processors; a request a processor's validate_params refuses, or extra_args with no
  processor loaded, is refused naming extra_args; speculative decoding and async scheduling are refused;
- a live server: vllm_xargs reach the processors; a bad one is a 400 naming vllm_xargs.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from ferrox import LLM, SamplingParams
from ferrox.config import EngineConfig
from ferrox.errors import InvalidArgumentError
from ferrox.logits_processor import MoveDirectionality, load_logits_processors
from ferrox.worker.custom_logits import CustomLogitsProcessors

from tests.helpers import logits_procs
from tests.helpers.logits_procs import CountUp, EchoPrompt, ForceToken
from tests.helpers.tiny_models import make_tiny_llama


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("lp") / "llama", num_layers=2, seed=11)


# ---- the batch updates --------------------------------------------------------------------------------
def test_batch_updates_carry_row_state_through_churn():
    """A processor applying each update (removed, added, moved) must end every step holding, at each row,
    the request of that row -- whatever the last step's layout was."""
    from ferrox import SamplingParams as SP

    rng = random.Random(0)
    custom = CustomLogitsProcessors([], None, __import__("torch").device("cpu"))
    live: list[int] = []
    next_slot = 0
    state: dict[int, int] = {}  # row -> slot, as a processor would keep it
    for _ in range(400):
        for slot in rng.sample(live, k=rng.randint(0, len(live))) if live and rng.random() < 0.4 else []:
            live.remove(slot)
            custom.remove([slot])
        for _ in range(rng.randint(0, 3)):
            if len(live) < 12:
                custom.add(next_slot, SP(extra_args={"slot": next_slot}), [1, 2])
                live.append(next_slot)
                next_slot += 1
        # This step: some of the live requests (not all are scheduled every step), in any order.
        step = rng.sample(live, k=rng.randint(min(1, len(live)), len(live))) if live else []
        if not step:
            continue
        prev_size = len(custom._rows)
        update = custom.batch_update(np.array(step, dtype=np.int32))
        if update is None:
            assert [state[i] for i in range(len(step))] == step
            continue
        bound = max(prev_size, len(step))
        for row in update.removed:
            del state[row]
        for row, params, _, _ in update.added:
            assert row not in state and row < bound
            state[row] = params.extra_args["slot"]
        for a, b, direction in update.moved:
            assert a < bound and b < bound
            if direction is MoveDirectionality.SWAP:
                state[a], state[b] = state[b], state[a]
            else:
                assert b not in state
                state[b] = state.pop(a)
        assert update.batch_size == len(step)
        assert state == dict(enumerate(step))


# ---- through the engine --------------------------------------------------------------------------------
PROMPTS = ["The quick brown fox jumps over the lazy dog again and again", "Paris is the capital of",
           "def add(a, b):\n    return a + b\n\nprint(add(1, 2))", "Numbers: 0 1 2 3 4 5 6 7 8 9",
           "Hello there, how are you doing today?", "Once upon a time in a land far away"]


def _requests(n: int) -> list[tuple[str, SamplingParams]]:
    out = []
    for i in range(n):
        extra = [{"force_token": 40 + i}, {"count_from": 100 + 10 * i}, {"echo": True}, None][i % 4]
        out.append((PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=0, max_tokens=6 + (i * 5) % 11,
                                                              ignore_eos=True, extra_args=extra)))
    return out


def test_processors_see_their_own_rows_through_churn(folder):
    kw = dict(model=folder, max_model_len=64, max_num_seqs=3, max_num_batched_tokens=8, num_gpu_blocks_override=9,
              block_size=8, seed=0)
    llm = LLM(logits_processors=[ForceToken, "tests.helpers.logits_procs:CountUp",
                                 "tests.helpers.logits_procs.EchoPrompt"], **kw)
    requests = _requests(12)
    outs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    assert llm.engine.stats()["num_preemptions"] > 0, "the KV cache was meant to preempt"
    plain = LLM(**kw)
    free = {i: plain.generate([p], s, use_tqdm=False)[0] for i, (p, s) in enumerate(requests) if s.extra_args is None}
    for i, ((_, params), out) in enumerate(zip(requests, outs, strict=True)):
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == params.max_tokens
        extra = params.extra_args
        if extra is None:
            assert tokens == list(free[i].outputs[0].token_ids), i
        elif "force_token" in extra:
            assert tokens == [extra["force_token"]] * len(tokens), (i, tokens)
        elif "count_from" in extra:
            assert tokens == list(range(extra["count_from"], extra["count_from"] + len(tokens))), (i, tokens)
        else:
            prompt = list(out.prompt_token_ids)
            assert tokens == [prompt[k % len(prompt)] for k in range(len(tokens))], (i, tokens)


def test_loading_and_refusals(folder):
    assert load_logits_processors(["tests.helpers.logits_procs:ForceToken", "tests.helpers.logits_procs.CountUp",
                                   EchoPrompt]) == (ForceToken, CountUp, EchoPrompt)
    for spec, message in (("tests.helpers.logits_procs:NotAProcessor", "not a subclass"),
                          ("tests.helpers.no_such_module:X", "importing"),
                          ("tests.helpers.logits_procs:Nothing", "has no"),
                          ("Bare", "not a class path"),
                          (logits_procs._PerRow, "abstract")):
        with pytest.raises(ValueError, match=f"logits_processors: .*{message}"):
            load_logits_processors([spec])
    with pytest.raises(ValueError, match="logits_processors: .*speculative"):
        EngineConfig(logits_processors=["a:B"], speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(logits_processors=["a:B"], async_scheduling=True)
    with pytest.raises(ValueError, match="logits_processors"):
        LLM(model=folder, logits_processors=["tests.helpers.logits_procs:NotAProcessor"])

    llm = LLM(model=folder, max_model_len=128, kv_cache_memory=32 << 20, logits_processors=[ForceToken])
    with pytest.raises(InvalidArgumentError, match="extra_args: ForceToken: force_token must be a token id") as info:
        llm.generate(["hi"], SamplingParams(max_tokens=2, extra_args={"force_token": "x"}), use_tqdm=False)
    assert info.value.param == "extra_args"
    ok = llm.generate(["hi"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True,
                                             extra_args={"force_token": 7}), use_tqdm=False)[0]
    assert list(ok.outputs[0].token_ids) == [7, 7, 7]
    bare = LLM(model=folder, max_model_len=128, kv_cache_memory=32 << 20)
    with pytest.raises(InvalidArgumentError, match="extra_args: only custom logits processors"):
        bare.generate(["hi"], SamplingParams(max_tokens=2, extra_args={"force_token": 7}), use_tqdm=False)


def test_a_failing_processor_fails_its_step_not_the_engine(folder):
    """A processor that raises fails the requests of that step (finish_reason "error" with its error), and the
    engine serves on with no KV block lost."""
    llm = LLM(model=folder, max_model_len=128, kv_cache_memory=32 << 20, logits_processors=[logits_procs.Boom])
    failed = llm.generate(["hi"], SamplingParams(max_tokens=3, extra_args={"boom": True}), use_tqdm=False)[0]
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert failed.error == "sampling with logits processors failed: RuntimeError: boom"
    out = llm.generate(["hi there"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"] - 1  # no block leaked


@pytest.mark.slow
def test_server_passes_vllm_xargs_to_the_processors(tmp_path):
    from tests.server.server_proc import ServerProcess, post_json

    srv = ServerProcess("--logits-processors", "tests.helpers.logits_procs:ForceToken", "--max-model-len", "512",
                        "--kv-cache-memory", "64MiB", env={"PYTHONPATH": str(logits_procs.__file__).rsplit("/tests/", 1)[0]})

    def post(body):
        return post_json(srv.base_url, body, "/v1/completions")

    try:
        status, body = post({"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                             "return_token_ids": True, "vllm_xargs": {"force_token": 33}})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == [33, 33, 33, 33]
        status, body = post({"prompt": "Hello", "max_tokens": 4, "vllm_xargs": {"force_token": -1}})
        assert status == 400 and body["error"]["param"] == "vllm_xargs", body
        assert "force_token must be a token id" in body["error"]["message"]
    finally:
        assert srv.stop() == 0
