"""AsyncLLM used directly: streaming kinds, n > 1, abort, bad requests, stats, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from ferrox import AsyncLLM, SamplingParams
from ferrox.engine.async_llm import EngineDeadError
from ferrox.errors import InvalidArgumentError
from ferrox.sampling_params import RequestOutputKind

from tests.server.server_proc import pid_alive


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM(max_model_len=512, kv_cache_memory=64 << 20)
    yield eng
    pid = eng.client.pid
    eng.shutdown()
    assert pid is not None and not pid_alive(pid), "engine core outlived shutdown()"
    # The prompt threads go with it, and a late request is told the engine is gone.
    with pytest.raises(EngineDeadError):
        asyncio.run(eng.run_in_prompt_pool(len, "late"))
    deadline = time.monotonic() + 5
    while any(t.name.startswith("ferrox-prompt") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "prompt threads outlived shutdown()"
        time.sleep(0.05)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def collect(engine: AsyncLLM, prompt, params: SamplingParams, rid: str) -> list:
    return [out async for out in engine.generate(prompt, params, rid)]


def test_cumulative_and_delta_agree(engine):
    async def run():
        prompt = "The capital of France is"
        return await asyncio.gather(
            collect(engine, prompt, greedy(8), "cum"),
            collect(engine, prompt, greedy(8, output_kind=RequestOutputKind.DELTA), "delta"),
            collect(engine, prompt, greedy(8, output_kind=RequestOutputKind.FINAL_ONLY), "final"),
        )

    cumulative, delta, final = asyncio.run(run())
    last = cumulative[-1]
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert len(last.outputs[0].token_ids) == 8
    # Cumulative outputs grow; deltas concatenate to the same text and tokens.
    texts = [o.outputs[0].text for o in cumulative]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert "".join(o.outputs[0].text for o in delta) == last.outputs[0].text
    assert sum((o.outputs[0].token_ids for o in delta), []) == last.outputs[0].token_ids
    assert len(final) == 1 and final[0].outputs[0].text == last.outputs[0].text
    assert last.prompt_token_ids == engine.get_tokenizer().encode("The capital of France is")


def test_stream_interval_gathers_delta_tokens(engine):
    """A DELTA stream with stream_interval 4: the first output at once, then outputs of 4 tokens or
    more (the last may be shorter), together the same tokens as a plain stream; the engine's own
    interval is the default; a bad one is refused by name."""
    async def run(rid: str, **kw) -> list:
        params = greedy(14, output_kind=RequestOutputKind.DELTA)
        return [o async for o in engine.generate("The capital of France is", params, rid, **kw)]

    plain = asyncio.run(run("plain"))
    gathered = asyncio.run(run("every4", stream_interval=4))
    sizes = [len(o.outputs[0].token_ids) for o in gathered]
    assert sum(sizes) == 14 and len(sizes) >= 3, sizes
    assert all(n >= 4 for n in sizes[1:-1]), sizes
    assert sum((o.outputs[0].token_ids for o in gathered), []) == sum((o.outputs[0].token_ids for o in plain), [])
    assert "".join(o.outputs[0].text for o in gathered) == "".join(o.outputs[0].text for o in plain)
    engine.stream_interval = 6
    try:
        sizes = [len(o.outputs[0].token_ids) for o in asyncio.run(run("engine-default"))]
    finally:
        engine.stream_interval = 1
    assert sum(sizes) == 14 and all(n >= 6 for n in sizes[1:-1]), sizes
    with pytest.raises(InvalidArgumentError, match="stream_interval"):
        asyncio.run(run("bad", stream_interval=0))
    with pytest.raises(InvalidArgumentError, match="stream_interval"):  # before any process starts
        AsyncLLM(max_model_len=512, stream_interval=0)


def test_token_id_prompt_and_n2(engine):
    async def run():
        ids = engine.get_tokenizer().encode("Hello")
        by_ids, by_text, n2 = await asyncio.gather(
            collect(engine, {"prompt_token_ids": ids}, greedy(4), "ids"),
            collect(engine, "Hello", greedy(4), "text"),
            collect(engine, "Hello", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4), "n2"),
        )
        return by_ids[-1], by_text[-1], n2[-1]

    by_ids, by_text, n2 = asyncio.run(run())
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert sorted(c.index for c in n2.outputs) == [0, 1] and n2.finished


def test_abort_frees_the_request(engine):
    async def run():
        gen = engine.generate("Once upon a time", greedy(400), "long")
        first = await anext(gen)
        assert not first.finished
        running = (await engine.get_stats())["num_running"]
        await engine.abort("long")
        rest = [out async for out in gen]
        deadline = time.monotonic() + 5
        while True:
            stats = await engine.get_stats()
            if stats["num_running"] == 0 and stats["kv_cache_usage"] == 0:
                return running, rest, stats
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.05)

    running, rest, stats = asyncio.run(run())
    assert running == 1
    assert len(rest) == 1 and rest[0].finished and rest[0].outputs[0].finish_reason == "abort"
    assert all(len(o.outputs[0].token_ids) < 400 for o in rest)


def test_closing_the_generator_aborts(engine):
    async def run():
        gen = engine.generate("Once upon a time", greedy(400), "closed")
        await anext(gen)
        await gen.aclose()  # what a cancelled server handler does
        deadline = time.monotonic() + 5
        while (stats := await engine.get_stats())["num_running"] != 0:
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.05)
        return stats

    assert asyncio.run(run())["kv_cache_usage"] == 0


def test_bad_request_fails_alone(engine):
    async def run():
        good = asyncio.create_task(collect(engine, "Hi", greedy(4), "good"))
        # Refused at the edge (the request rules run before the request crosses to the core).
        with pytest.raises(InvalidArgumentError, match="stop_token_ids") as bad:
            await collect(engine, "Hi", greedy(4, stop_token_ids=[10**8]), "bad")
        assert bad.value.param == "stop_token_ids"
        with pytest.raises(ValueError, match="prompt"):
            await collect(engine, {"prompt_token_ids": [1] * 600}, greedy(4), "too-long")
        return await good

    outs = asyncio.run(run())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4


def test_n3_siblings_reuse_the_prompt_blocks(engine):
    # A prompt no other test uses, so the first sample misses the cache and only its siblings hit.
    words = "amber basalt cobalt dune ember fjord granite harbor iris jasper kelp lagoon".split()
    prompt = " ".join(words[i % len(words)] + str(i) for i in range(40))
    num_prompt = len(engine.get_tokenizer().encode(prompt))
    assert 90 <= num_prompt <= 140, num_prompt
    full_block_tokens = (num_prompt - 1) // 16 * 16  # the last prompt token is always recomputed

    async def run():
        before = (await engine.get_stats())["prefix_cache_hits"]
        outs = await collect(engine, prompt, greedy(6, n=3), "n3-cached")
        after = (await engine.get_stats())["prefix_cache_hits"]
        await engine.reset_prefix_cache()
        alone = await collect(engine, prompt, greedy(6), "n3-alone")
        return outs[-1], after - before, alone[-1]

    last, hits, alone = asyncio.run(run())
    assert last.finished and sorted(c.index for c in last.outputs) == [0, 1, 2]
    # The samples go to the core in one step; the core caches the first's full prompt blocks as it
    # allocates them, so the other two hit all of them (and read K/V written in that same step).
    assert 2 * full_block_tokens <= hits <= 2 * num_prompt, (hits, num_prompt)
    assert all(c.token_ids == alone.outputs[0].token_ids for c in last.outputs)


def test_abort_before_any_output(engine):
    async def run():
        prompt = "Tell me a long story about a dragon and a knight. " * 4
        params = SamplingParams(n=3, temperature=0, max_tokens=100, ignore_eos=True)
        task = asyncio.create_task(collect(engine, prompt, params, "n3-ab"))
        await asyncio.sleep(0)  # the generator sends the samples and waits for output
        await engine.abort("n3-ab")
        outs = await task
        deadline = time.monotonic() + 5
        while (stats := await engine.get_stats())["num_running"] + stats["num_waiting"] != 0:
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.05)
        return outs, stats

    outs, stats = asyncio.run(run())
    assert len(outs) == 1 and outs[0].finished
    assert [c.finish_reason for c in outs[0].outputs] == ["abort"] * 3
    assert stats["kv_cache_usage"] == 0


def test_abort_yields_a_final_abort_output(engine):
    async def run():
        params = greedy(400, n=2, output_kind=RequestOutputKind.DELTA)
        gen = engine.generate("Once upon a time", params, "abort-final")
        first = await anext(gen)
        await engine.abort("abort-final")
        return first, [out async for out in gen]

    first, rest = asyncio.run(run())
    assert not first.finished
    assert len(rest) == 1 and rest[0].finished
    assert sorted(c.index for c in rest[0].outputs) == [0, 1]
    assert all(c.finish_reason == "abort" for c in rest[0].outputs)
    assert all(len(c.token_ids) < 400 for c in rest[0].outputs)


def test_server_sse_ends_cleanly_on_abort(engine):
    import json

    from aiohttp.test_utils import TestClient, TestServer
    from ferrox.entrypoints.openai.server import METRICS, build_app

    async def run():
        app = build_app(engine)
        chunks: list = []
        async with TestClient(TestServer(app)) as client:
            body = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 400,
                    "ignore_eos": True, "stream": True}
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status == 200
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                chunks.append(line[6:])
                if len(chunks) == 3:  # role chunk + two content chunks: the request is running
                    await engine.abort(json.loads(chunks[0])["id"])
        engine.stat_loggers.remove(app[METRICS])  # the module's engine outlives this app
        return chunks

    chunks = asyncio.run(run())
    assert chunks[-1] == "[DONE]", chunks[-3:]
    last = json.loads(chunks[-2])
    assert last["choices"][0]["finish_reason"] == "abort", last


def test_short_prompt_work_runs_inline_long_work_in_the_prompt_threads(engine):
    """Short prompts are encoded on the event loop (a hop to the prompt threads waits for the GIL
    while the loop streams); long ones still go to the threads, and an error raised inline reaches
    the caller unchanged either way."""
    from ferrox.engine.input_processor import INLINE_PROMPT_SIZE, prompt_size

    def where(_text: str) -> str:
        return threading.current_thread().name

    def fail(_text: str) -> None:
        raise InvalidArgumentError("prompt: bad", param="prompt")

    async def run() -> tuple[str, str, str]:
        short, long = "Hello there", "x" * (INLINE_PROMPT_SIZE + 1)
        inline = await engine.prompt_work(prompt_size(short), where, short)
        pooled = await engine.prompt_work(prompt_size(long), where, long)
        loop_thread = threading.current_thread().name
        for text in (short, long):
            with pytest.raises(InvalidArgumentError):
                await engine.prompt_work(prompt_size(text), fail, text)
        return inline, pooled, loop_thread

    inline, pooled, loop_thread = asyncio.run(run())
    assert inline == loop_thread
    assert pooled.startswith("ferrox-prompt")


def test_prompt_size_counts_what_must_be_encoded():
    from ferrox.engine.input_processor import INLINE_PROMPT_SIZE, prompt_size
    from ferrox.entrypoints.openai.protocol import ChatCompletionRequest

    assert prompt_size("abcd") == 4
    assert prompt_size([1] * 400) == 100  # token ids: checked, not encoded
    assert prompt_size({"prompt_token_ids": [1] * 40, "prompt": "text"}) == 10 + 4
    assert prompt_size(["ab", [1, 2, 3, 4], {"prompt": "xyz"}]) == 2 + 1 + 3
    long = "w" * 5000
    chat = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": long}]},
    ])
    assert prompt_size(chat) > INLINE_PROMPT_SIZE  # a long message inside a request model counts
    assert prompt_size(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])) < 64
    # A huge batch is sized only up to the limit.
    assert INLINE_PROMPT_SIZE < prompt_size(["x" * 600] * 1_000_000) < 2 * INLINE_PROMPT_SIZE
