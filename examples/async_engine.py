"""AsyncLLM without a server: the engine core runs in its own process; stream deltas, abort one."""

import asyncio

from ferrox import AsyncLLM, SamplingParams
from ferrox.sampling_params import RequestOutputKind


async def main() -> None:
    engine = AsyncLLM(max_model_len=1024)  # the embedded SmolLM2-135M-Instruct
    params = SamplingParams(max_tokens=48, temperature=0, output_kind=RequestOutputKind.DELTA)
    async for out in engine.generate("The three primary colors are", params, request_id="colors"):
        print(out.outputs[0].text, end="", flush=True)
    print()
    long = engine.generate("Once upon a time", SamplingParams(max_tokens=500), request_id="story")
    print((await anext(long)).outputs[0].text, "...")
    await engine.abort("story")  # frees its KV blocks; the generator ends (finish_reason "abort")
    print(await engine.get_stats())
    engine.shutdown()


asyncio.run(main())
