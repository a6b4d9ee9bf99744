"""Short prompts queued behind long ones: time to first token with and without concurrent partial prefills
(--max-num-partial-prefills / --max-long-partial-prefills, rust/partial_prefills.rs).

    python benches/bench_partial_prefills.py                       # Llama-3.1-8B dummy: 4 x 16k then 32 x 256
    python benches/bench_partial_prefills.py --threshold 2048      # a long prompt's chunks capped at 2048
    python benches/bench_partial_prefills.py --config <tiny>/config.json --long-len 2048 --budget 512   # CPU

The head-of-line case: `--long` long prompts arrive first, then `--short` short ones, all at once (one
`generate` call, in that order), every request answering 8 tokens. The default engine (vLLM V1's scheduler)
prefills the long prompts with the whole step budget and the short ones wait for their last chunk; the other
engine lets `--partial` prompts prefill together, at most one of them long, so the short prompts pass. Both
engines run in this process one after the other. Printed: the short prompts' median and p90 time to first
token, the long ones' median, the wall time of the whole batch; last, the short prompts' median TTFT ratio.
Also printed: how many requests got the same greedy tokens from both engines (in bf16 the batches' different
shapes round differently: an H100 run had 23/36; in float32 they are equal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402


def run(folder: str, args: argparse.Namespace, longs: list, shorts: list, partial: tuple[int, int] | None) -> dict:
    from ferrox import LLM, SamplingParams

    extra: dict = {}
    if partial:
        extra = {"max_num_partial_prefills": partial[0], "max_long_partial_prefills": partial[1]}
        if args.threshold:
            extra["long_prefill_token_threshold"] = args.threshold
    if args.budget:
        extra["max_num_batched_tokens"] = args.budget
    llm = LLM(model=folder, load_format="dummy", dtype=args.dtype, max_model_len=args.long_len + 256, **extra)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    try:
        llm.generate(shorts[:2], params, use_tqdm=False)  # warm
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = llm.generate(longs + shorts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        bench_setup.release_engine(llm)
    ttft = [(o.metrics.first_token_time - o.metrics.arrival_time) * 1e3 for o in outs]
    short, long = sorted(ttft[len(longs):]), sorted(ttft[:len(longs)])
    return {"short_ttft_p50_ms": statistics.median(short), "short_ttft_p90_ms": short[int(0.9 * (len(short) - 1))],
            "long_ttft_p50_ms": statistics.median(long), "wall_s": wall,
            "tokens": [list(o.outputs[0].token_ids) for o in outs]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="short-prompt TTFT behind long prompts, partial prefills on/off")
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=16384)
    parser.add_argument("--short", type=int, default=32)
    parser.add_argument("--short-len", type=int, default=256)
    parser.add_argument("--partial", default="4,1", help="max_num_partial_prefills,max_long_partial_prefills")
    parser.add_argument("--threshold", type=int, default=None,
                        help="--long-prefill-token-threshold with partial prefills (default: vLLM's 4%% of the context)")
    parser.add_argument("--budget", type=int, default=None, help="--max-num-batched-tokens (default: the engine's)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    folder, max_id = bench_setup.dummy_model_dir(args.config)
    longs = bench_setup.random_prompts(args.long, args.long_len, max_id, seed=1)
    shorts = bench_setup.random_prompts(args.short, args.short_len, max_id, seed=2)
    partial = tuple(int(x) for x in args.partial.split(","))
    assert len(partial) == 2
    plain = run(folder, args, longs, shorts, None)
    shared = run(folder, args, longs, shorts, partial)  # type: ignore[arg-type]
    same = sum(a == b for a, b in zip(plain.pop("tokens"), shared.pop("tokens"), strict=True))
    result = {"env": bench_setup.environment(), "args": vars(args), "default": plain, "partial_prefills": shared,
              "same_tokens": same, "requests": args.long + args.short,
              "short_ttft_ratio": plain["short_ttft_p50_ms"] / shared["short_ttft_p50_ms"]}
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    for name, r in (("default", plain), (f"partial prefills {args.partial}", shared)):
        print(f"{name}: short TTFT p50 {r['short_ttft_p50_ms']:.1f} ms, p90 {r['short_ttft_p90_ms']:.1f} ms; long TTFT "
              f"p50 {r['long_ttft_p50_ms']:.1f} ms; batch {r['wall_s']:.2f} s")
    print(f"same greedy tokens {same}/{result['requests']}; short prompts' median TTFT "
          f"{result['short_ttft_ratio']:.2f}x faster with partial prefills")
    return result


if __name__ == "__main__":
    main()
