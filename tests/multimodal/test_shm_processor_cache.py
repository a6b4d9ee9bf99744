"""`--mm-processor-cache-type shm` end to end: a tiny LLaVA behind two data-parallel engine-core processes takes its
images through the front-end's shared-memory store (a repeated image, also one sent to both cores, as a reference
only) and answers with the greedy tokens of an 'lru' engine (the offline LLM, in-process: pixels never leave it);
every reference is acknowledged; the segment is gone after shutdown. Configuration: the flags, their errors by name, the cases
without a store."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
from ferrox import LLM, AsyncLLM, SamplingParams
from ferrox.config import EngineConfig
from ferrox.entrypoints import cli

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = "USER: <image>\nWhat is this? ASSISTANT:"
TINY = {"dtype": "float32", "device": "cpu", "max_model_len": 256, "kv_cache_memory": 8 << 20}


def _image(seed: int):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 255, (40, 60, 3), dtype=np.uint8))


def test_shm_gives_the_lru_tokens_through_two_cores_and_leaves_nothing(tmp_path):
    from tests.helpers.tiny_models import make_tiny_llava

    folder = make_tiny_llava(tmp_path / "llava")
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": _image(seed)}} for seed in (1, 1, 2, 1)]
    engine = AsyncLLM(model=folder, mm_processor_cache_type="shm", mm_processor_cache_gb=0.01, data_parallel_size=2,
                      disable_log_stats=True, **TINY)
    try:
        lru = LLM(model=folder, **TINY)  # the reference: 'lru', pixels inline (here: in-process)
        want = [o.outputs[0].token_ids for o in lru.generate(prompts, GREEDY, use_tqdm=False)]
        two = SamplingParams(n=2, max_tokens=6, temperature=0.0, ignore_eos=True)
        want_two = [c.token_ids for c in lru.generate(prompts[2], two, use_tqdm=False)[0].outputs]
        lru.engine.shutdown()
        store = engine.client.mm_store
        assert store is not None and os.path.exists(f"/dev/shm/{store.writer.name}")

        async def run(prompt, params, rid):
            return [out async for out in engine.generate(prompt, params, rid)][-1]

        async def all_of_them():
            # One at a time, then together (the router spreads them over both cores: one image read by each).
            alone = [await run(p, GREEDY, f"a{i}") for i, p in enumerate(prompts)]
            together = await asyncio.gather(*(run(p, GREEDY, f"b{i}") for i, p in enumerate(prompts)),
                                            run(prompts[2], two, "n2"))
            return alone, together

        alone, together = asyncio.run(all_of_them())
        assert [o.outputs[0].token_ids for o in alone] == want
        assert [o.outputs[0].token_ids for o in together[:-1]] == want
        assert [c.token_ids for c in together[-1].outputs] == want_two
        writer = store.writer
        # Two distinct images stored once each; every other send a reference: 2 repeats alone, 4 + 2 samples together.
        assert (writer.stored, writer.inline, writer.referenced) == (2, 0, 8)
        assert writer.pending() == 0  # each reference sent was read and acknowledged by its core
        name = writer.name
    finally:
        engine.shutdown()
    assert not os.path.exists(f"/dev/shm/{name}")


def _parse(*argv: str) -> EngineConfig:
    return cli.engine_config_from_args(cli.build_parser().parse_args(["serve", *argv]))


def test_flags_and_errors_by_name():
    config = _parse("--mm-processor-cache-type", "shm", "--mm-shm-cache-max-object-size-mb", "64")
    assert (config.mm_processor_cache_type, config.mm_shm_cache_max_object_size_mb) == ("shm", 64)
    assert EngineConfig().mm_shm_cache_max_object_size_mb == 128  # vLLM's default
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="mm_shm_cache_max_object_size_mb: must be a positive integer"):
            EngineConfig(mm_shm_cache_max_object_size_mb=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mm_processor_cache_type: 'redis' is not one of lru, shm"):
        EngineConfig(mm_processor_cache_type="redis")


def test_no_store_without_room():
    """mm_processor_cache_gb 0 turns the store off (vLLM's cache off): items go inline. (The offline LLM never makes
    one: its core runs in the caller's process, where items never cross a socket.)"""
    from ferrox.multimodal.shm_items import ShmItemSender

    assert ShmItemSender.for_config(EngineConfig(mm_processor_cache_type="shm", mm_processor_cache_gb=0), 1) is None
    assert ShmItemSender.for_config(EngineConfig(mm_processor_cache_gb=1), 1) is None  # 'lru'
