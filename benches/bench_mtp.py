"""MTP speculation's cost (speculative_config method "mtp": worker/mtp_proposer.py) on a GPU, side by side in one process.

Dummy weights draft at random, so (almost) every draft is rejected: what this measures is what MTP speculation costs
a step -- the verify step of 1 + k tokens, the MTP layer's pass over the step's pairs, its k - 1 chained rounds --
against a plain decode step, and so the acceptance it needs to pay off. On Qwen3.5-9B's shape (bench_hybrid's
config, with its MTP layer: mtp_num_hidden_layers 1), bf16:

1. batch 1: ms per step (each step emits one token when nothing is accepted) without speculation, and with MTP
   k = 1, 2, 3; the break-even mean acceptance length (tokens per step needed to match plain decoding);
2. batch 32: output tokens/s of the same, 32 x (128 in, 128 out).

    python benches/bench_mtp.py [--model qwen3.5-9b|qwen3.5-35b-a3b] [--ks 1 3]

The last line is the batch-1 step-time ratio of MTP k = 1 to plain decoding.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402
from bench_hybrid import CONFIGS  # noqa: E402


def _engine(folder: str, k: int, max_num_seqs: int):
    from ferrox import LLM

    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    # (a fixed KV cache: each engine in turn, the same cache, whatever the last one left in the allocator)
    return LLM(model=folder, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=max_num_seqs,
               enable_prefix_caching=False, speculative_config=spec, kv_cache_memory=8 << 30)


def _run(llm, prompts, output_len: int) -> tuple[float, int, dict]:
    from ferrox import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # (warm)
    before = dict(llm.engine.stats())
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats()
    delta = {key: stats.get(key, 0) - before.get(key, 0) for key in ("spec_num_drafts", "spec_num_accepted_tokens")}
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs), delta


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(CONFIGS), default="qwen3.5-9b")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--output-len-b1", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    config = {**CONFIGS[args.model], "mtp_num_hidden_layers": 1}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config))
        folder = bench_setup.make_model_dir(path, str(Path(tmp) / "model"))
        one = bench_setup.random_prompts(2, 32, 200_000)
        many = bench_setup.random_prompts(args.batch, 128, 200_000, seed=1)
        rows = []
        for k in [0, *args.ks]:
            llm = _engine(folder, k, max(args.batch, 2))
            s1, n1, d1 = _run(llm, one[:1], args.output_len_b1)
            sb, nb, _ = _run(llm, many, 128)
            bench_setup.release_engine(llm)
            del llm
            steps = d1["spec_num_drafts"] or n1  # (without drafts a step emits one token)
            rows.append({"k": k, "b1_ms_per_step": 1e3 * s1 / max(steps, 1), "b1_ms_per_token": 1e3 * s1 / n1,
                         "b1_accepted": d1["spec_num_accepted_tokens"], "batch_tok_s": nb / sb})
    plain = rows[0]["b1_ms_per_step"]
    print(f"{args.model}, bf16 dummy weights (drafts rejected), {bench_setup.environment()['gpu']}")
    print("| MTP k | batch-1 ms / step | vs plain | break-even tokens / step | accepted | "
          f"batch {args.batch} output tok/s | vs plain |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = r["b1_ms_per_step"] / plain
        print(f"| {r['k'] or 'off'} | {r['b1_ms_per_step']:.2f} | {ratio:.2f}x | {ratio:.2f} | {r['b1_accepted']} | "
              f"{r['batch_tok_s']:.0f} | {r['batch_tok_s'] / rows[0]['batch_tok_s']:.2f}x |")
    result = {"benchmark": "mtp", "model": args.model, "rows": rows}
    print(json.dumps(result))
    print(f"batch-1 step with MTP k=1 / plain decode step: {rows[1]['b1_ms_per_step'] / plain:.2f}x")
    return result


if __name__ == "__main__":
    main()
