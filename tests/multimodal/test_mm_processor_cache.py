"""vLLM's multimodal processor cache (`--mm-processor-cache-gb`, `--mm-processor-cache-type lru`): processed images
and videos kept by content and processor settings in an LRU bounded by their arrays' bytes; a hit is what processing
again gives, in the caller's own copy; 0 turns it off. On a server of a tiny LLaVA: the same image twice gives the
same answer with the cache on and off, vLLM's `mm_cache_hits` moves on the repeat, and stays 0 with the flag 0."""

from __future__ import annotations

import base64
import io
import re
import threading
import urllib.request

import numpy as np
import pytest
from ferrox.config import EngineConfig
from ferrox.entrypoints import cli
from ferrox.multimodal.image_processor import ImageProcessor
from ferrox.multimodal.processor_cache import GIB, ProcessorCache, video_key
from ferrox.multimodal.qwen2_vl_processing import QwenVLImageProcessor
from ferrox.multimodal.video import Video

PIL = pytest.importorskip("PIL.Image")

CLIP = {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 28},
        "crop_size": {"height": 28, "width": 28}}
QWEN = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16}


def _image(seed: int = 0, size: tuple[int, int] = (40, 60)):
    return PIL.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))


class Blocks:
    """A processor whose item is a byte count: it returns that many bytes of float32 and counts its calls."""

    def __init__(self, fill: float = 1.0) -> None:
        self.fill = fill
        self.calls = 0

    def __call__(self, nbytes: int) -> np.ndarray:
        self.calls += 1
        return np.full(nbytes // 4, self.fill, dtype=np.float32)


# ---- the cache ----------------------------------------------------------------------------------------------------
def test_lru_eviction_by_bytes():
    cache, make = ProcessorCache(2500), Blocks()
    for key in ("a", "b"):
        cache.process(make, "__call__", 1000, key)
    assert len(cache) == 2 and cache.size_bytes == 2000
    cache.process(make, "__call__", 1000, "a")  # a hit: "a" is now the most recently used
    cache.process(make, "__call__", 1000, "c")  # over the budget: "b", the least recently used, goes
    assert cache.size_bytes == 2000 and make.calls == 3
    cache.process(make, "__call__", 1000, "a")
    assert make.calls == 3  # still there
    cache.process(make, "__call__", 1000, "b")
    assert make.calls == 4  # processed again
    assert (cache.queries, cache.hits) == (6, 2)


def test_an_item_larger_than_the_budget_is_not_kept_and_evicts_nothing():
    cache, make = ProcessorCache(2500), Blocks()
    cache.process(make, "__call__", 1000, "small")
    big = cache.process(make, "__call__", 4000, "big")
    assert big.nbytes == 4000 and len(cache) == 1 and cache.size_bytes == 1000
    cache.process(make, "__call__", 4000, "big")
    cache.process(make, "__call__", 1000, "small")
    assert make.calls == 3 and (cache.queries, cache.hits) == (4, 1)


def test_zero_gib_is_no_cache():
    assert ProcessorCache.of_gib(0) is None
    assert ProcessorCache.of_gib(4).capacity_bytes == 4 * GIB
    assert EngineConfig().mm_processor_cache_gb == 4 and EngineConfig().mm_processor_cache_type == "lru"


def test_a_hit_is_fresh_processing_in_a_copy_of_its_own():
    processor, image = ImageProcessor(CLIP), _image()
    fresh = processor.one(image)
    assert np.array_equal(fresh, processor([image])[0])  # one image's row of the batch
    cache = ProcessorCache(GIB)
    first = cache.process(processor, "one", image, "img")
    first += 100.0  # the caller's in-place change ...
    second = cache.process(processor, "one", image, "img")
    assert cache.hits == 1 and np.array_equal(second, fresh)  # ... is not in the entry
    second[:] = 0
    assert np.array_equal(cache.process(processor, "one", image, "img"), fresh)
    assert second.flags.writeable

    # Tuples of arrays and grids (Qwen2-VL's patches) come back equal, with the same types.
    qwen = QwenVLImageProcessor(QWEN)
    want = qwen(image)
    got = [cache.process(qwen, "__call__", image, "img") for _ in range(2)]
    for patches, grid in got:
        assert np.array_equal(patches, want[0]) and grid == want[1] and isinstance(grid, tuple)
    assert got[0][0] is not got[1][0]


def test_processor_settings_are_part_of_the_key():
    """Processors with other settings (a request's mm_processor_kwargs make new ones) get their own entries; equal
    settings in another object (the same kwargs derived again) share them; another method too has its own."""
    image, cache = _image(size=(112, 112)), ProcessorCache(GIB)
    default, small = QwenVLImageProcessor(QWEN), QwenVLImageProcessor({**QWEN, "max_pixels": 56 * 56})
    full = cache.process(default, "__call__", image, "img")
    reduced = cache.process(small, "__call__", image, "img")
    assert cache.hits == 0 and reduced[1] != full[1]  # other pixels, not the first processor's entry
    assert np.array_equal(reduced[0], small(image)[0])
    again = cache.process(QwenVLImageProcessor({**QWEN, "max_pixels": 56 * 56}), "__call__", image, "img")
    assert cache.hits == 1 and again[1] == reduced[1]
    clip = ImageProcessor(CLIP)
    cache.process(clip, "one", image, "img")
    cache.process(clip, "__call__", [image], "img")  # the batch call is another entry
    assert cache.hits == 1 and len(cache) == 4


def test_a_processor_whose_settings_cannot_be_described_is_not_cached():
    make = Blocks()
    make.hook = lambda x: x  # code, not data: no telling two of them apart
    cache = ProcessorCache(GIB)
    for _ in range(2):
        cache.process(make, "__call__", 1000, "a")
    assert make.calls == 2 and len(cache) == 0 and cache.queries == 0


def test_video_key_covers_the_metadata_a_processor_reads():
    frames = np.zeros((4, 8, 8, 3), np.uint8)
    base = Video(frames, fps=2.0, total_frames=8, indices=[0, 2, 4, 6])
    assert video_key(base) == video_key(Video(frames.copy(), fps=2.0, total_frames=8, indices=[0, 2, 4, 6]))
    # The same frames picked elsewhere in the source (Qwen3-VL's timestamps differ), or at another rate.
    assert video_key(base) != video_key(Video(frames, fps=2.0, total_frames=8, indices=[1, 3, 5, 7]))
    assert video_key(base) != video_key(Video(frames, fps=4.0, total_frames=16, indices=[0, 4, 8, 12]))


def test_threads_share_the_cache():
    cache, make = ProcessorCache(GIB), Blocks()
    results: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda: results.append(cache.process(make, "__call__", 4000, "x")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and all(np.array_equal(r, results[0]) for r in results)
    assert cache.queries == 8 and cache.hits == 8 - make.calls and len(cache) == 1


def test_offline_metrics_read_the_cache():
    from ferrox.engine.offline_stats import OfflineStats
    from ferrox.metrics.reader import Counter

    cache = ProcessorCache(GIB)
    for _ in range(3):
        cache.process(Blocks(), "__call__", 400, "a")
    stats = OfflineStats("m", 64, cache)
    try:
        counters = {m.name: m for m in stats.metrics() if isinstance(m, Counter)}
    finally:
        stats.close()
    assert counters["vllm:mm_cache_queries"].value == 3 and counters["vllm:mm_cache_hits"].value == 2
    assert counters["vllm:mm_cache_hits"].labels == {"model_name": "m", "engine": "0"}


# ---- configuration ------------------------------------------------------------------------------------------------
def _parse(*argv: str) -> EngineConfig:
    return cli.engine_config_from_args(cli.build_parser().parse_args(["serve", *argv]))


def test_flags_and_bad_values_refused_by_name():
    assert _parse("--mm-processor-cache-gb", "0").mm_processor_cache_gb == 0
    assert _parse("--mm-processor-cache-gb", "8", "--mm-processor-cache-type", "lru").mm_processor_cache_gb == 8
    assert EngineConfig.from_kwargs(mm_processor_cache_gb=0.5).mm_processor_cache_gb == 0.5  # LLM(...)'s keyword
    for value in (-1, True, "4", float("nan"), float("inf"), None):
        with pytest.raises(ValueError, match="mm_processor_cache_gb: must be a number of GiB >= 0"):
            EngineConfig(mm_processor_cache_gb=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mm_processor_cache_gb"):
        _parse("--mm-processor-cache-gb", "-2")
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--mm-processor-cache-gb", "lots"])
    assert _parse("--mm-processor-cache-type", "shm").mm_processor_cache_type == "shm"  # (test_shm_processor_cache.py)
    with pytest.raises(ValueError, match="mm_processor_cache_type: 'redis' is not one of lru, shm"):
        EngineConfig(mm_processor_cache_type="redis")


# ---- a server of a tiny LLaVA -------------------------------------------------------------------------------------
def _png(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _counter(base_url: str, name: str) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(rf'^{re.escape(name)}_total{{engine="0",model_name="llava"}} (\S+)$', text, re.MULTILINE)
    assert found, text
    return float(found.group(1))


def test_server_same_answers_and_hit_counts_with_the_cache_on_and_off(tmp_path):
    from tests.helpers.tiny_models import make_tiny_llava
    from tests.server.server_proc import ServerProcess
    from tests.server.server_proc import post_json as post

    folder = make_tiny_llava(tmp_path / "llava")
    args = (folder, "--served-model-name", "llava", "--dtype", "float32", "--metrics-prefix", "vllm")
    servers: dict[str, ServerProcess] = {}
    errors: list[BaseException] = []

    def start(name: str, *extra: str) -> None:  # (both at once: start-up dominates)
        try:
            servers[name] = ServerProcess(*args, *extra)
        except BaseException as e:
            errors.append(e)

    starts = [threading.Thread(target=start, args=("on",)),
              threading.Thread(target=start, args=("off", "--mm-processor-cache-gb", "0"))]
    for t in starts:
        t.start()
    for t in starts:
        t.join()
    try:
        assert not errors, errors
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png(_image(7))}},
                                                 {"type": "text", "text": "What is this?"}]}]
        body = {"model": "llava", "messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True,
                "return_tokens_as_token_ids": True}
        answers: dict[str, list] = {}
        for name, srv in servers.items():
            for _ in range(2):
                status, out = post(srv.base_url, body)
                assert status == 200, out
                choice = out["choices"][0]
                answers.setdefault(name, []).append(
                    ([t["token"] for t in choice["logprobs"]["content"]], choice["message"]["content"]))
        assert answers["on"][0] == answers["on"][1] == answers["off"][0] == answers["off"][1]
        assert _counter(servers["on"].base_url, "vllm:mm_cache_queries") == 2
        assert _counter(servers["on"].base_url, "vllm:mm_cache_hits") == 1
        assert _counter(servers["off"].base_url, "vllm:mm_cache_queries") == 0
        assert _counter(servers["off"].base_url, "vllm:mm_cache_hits") == 0
    finally:
        for srv in servers.values():
            srv.stop()

    # The offline LLM prepares its prompts through its own cache (LLM(mm_processor_cache_gb=...), default 4 GiB).
    from ferrox import LLM, SamplingParams
    from ferrox.metrics.reader import Counter
    from ferrox.multimodal.processing import image_prompts_for_model

    llm = LLM(model=folder, dtype="float32", device="cpu", disable_log_stats=False)
    greedy = SamplingParams(max_tokens=8, temperature=0)
    outs = [llm.chat(messages, greedy, use_tqdm=False)[0].outputs[0] for _ in range(2)]
    assert [[f"token_id:{t}" for t in o.token_ids] for o in outs] == [answers["on"][0][0]] * 2
    counters = {m.name: m.value for m in llm.get_metrics() if isinstance(m, Counter) and "mm_cache" in m.name}
    assert counters == {"vllm:mm_cache_queries": 2, "vllm:mm_cache_hits": 1}
    rules = llm.engine.image_prompts
    assert rules.processor_cache is not None and rules.processor_cache.capacity_bytes == 4 * GIB
    hf_config = {"architectures": ["LlavaForConditionalGeneration"], "image_token_index": rules.image_token_id}
    assert image_prompts_for_model(folder, hf_config, llm.get_tokenizer(), processor_cache_gb=0).processor_cache is None
