"""Speculative decoding on a GPU (issue 13's H200 figures), side by side in one process:

1. Verify-step cost: one forward of a batch-1 request computing 1 + k tokens (its k drafts) over a
   context, relative to the one-token decode step at the same context (both eager and, for the
   decode step, the CUDA graph the engine replays). A dummy step scheduled by the real core with
   prompt-lookup drafts (a prompt of one repeated token always has a match).
2. Overhead when speculation does not help: random weights accept (almost) nothing, so n-gram
   speculation on vs off over the same batch of requests; throughput ratio (target >= 0.95).
3. The ceiling: draft-model speculation with the target as its own draft (every draft accepted),
   batch 1, ms per output token vs plain decoding.
4. Output that repeats (a small random Llama falls into loops, so prompt lookup is accepted):
   n-gram speculation with async scheduling and with synchronous steps vs none, batch 1 and 16.

    python benches/bench_spec_gpu.py [--config benches/configs/llama-3.1-8b] [--context 512]

Prints a table per part; the last line is the overhead ratio of part 2.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402

MAX_ID = 120000  # prompt token ids below Llama-3's special tokens


def _verify_step(k: int, context: int, block_size: int):
    """A SchedulerOutput of one request computing 1 + k tokens at seq_len context + k (drafts
    proposed by the core's prompt lookup over a prompt of one repeated token)."""
    from ferrox import _core

    blocks = -(-(context + k + 2) // block_size) + 2
    sched = _core.Scheduler(num_blocks=blocks, max_model_len=context + k + 2, block_size=block_size,
                            max_num_seqs=1, max_num_batched_tokens=context + k + 2, enable_prefix_caching=False,
                            num_speculative_tokens=k, speculative_method="ngram", prompt_lookup_min=1,
                            prompt_lookup_max=1)
    sched.add_request("verify", np.zeros(context - 1, dtype=np.int64), max_tokens=k + 4, ignore_eos=True,
                      detokenize=False)
    sched.schedule()
    sched.update_from_output(np.zeros(1, dtype=np.int64))
    so = sched.schedule()
    if np.asarray(so.num_scheduled_tokens).tolist() != [1 + k]:
        raise RuntimeError(f"expected a verify step of {1 + k} tokens, got {np.asarray(so.num_scheduled_tokens)}")
    return so


def _time_ms(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def verify_costs(model_dir: str, context: int, ks: list[int]) -> list[tuple[str, float, float]]:
    from ferrox import LLM
    from ferrox.worker.dummy_batch import decode_step, upload_step
    from ferrox.worker.step_inputs import Uploader

    llm = LLM(model=model_dir, load_format="dummy", max_model_len=context + 64, max_num_seqs=8)
    runner = llm.engine.runner
    model, kv = runner.model, runner.kv_caches
    bs = llm.engine.block_size
    upload = Uploader(torch.device("cuda"))

    def forward_of(so):
        upload.next_step()
        t = upload_step(so, upload)
        return lambda: model.compute_logits(model.forward(t.input_ids, t.positions, kv, t.meta)[t.logits_indices])

    decode = decode_step(1, context, bs, num_blocks=int(kv[0].shape[1]))
    rows = []
    base = _time_ms(forward_of(decode.so))
    rows.append(("decode (1 token), eager", base, 1.0))
    graphs = runner.graph_runner
    if graphs is not None:
        upload.next_step()
        t = upload_step(decode.so, upload)
        graph_ms = _time_ms(lambda: model.compute_logits(graphs.run(t.input_ids, t.positions, t.meta)))
        rows.append(("decode (1 token), CUDA graph", graph_ms, graph_ms / base))
    from ferrox.worker.cuda_graphs import CudaGraphRunner

    for k in ks:
        so = _verify_step(k, context, bs)
        ms = _time_ms(forward_of(so))
        rows.append((f"verify k={k} ({k + 1} tokens), eager", ms, ms / base))
        # What an engine with speculative_config k replays (worker/cuda_graphs.py verify graphs).
        verify = CudaGraphRunner(model, kv, max_num_seqs=1, max_model_len=context + 64, block_size=bs,
                                 device=torch.device("cuda"), verify_len=k + 1)
        verify.capture()
        upload.next_step()
        t = upload_step(so, upload)
        ms = _time_ms(lambda t=t, g=verify: model.compute_logits(g.run(t.input_ids, t.positions, t.meta)))
        rows.append((f"verify k={k} ({k + 1} tokens), CUDA graph", ms, ms / base))
        del verify
    llm.engine.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def overhead_ratio(model_dir: str, num_prompts: int, input_len: int, output_len: int, k: int) -> dict[str, float]:
    from ferrox import LLM, SamplingParams

    prompts = bench_setup.random_prompts(num_prompts, input_len, MAX_ID, seed=1)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    out: dict[str, float] = {}
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    # Async scheduling for both (the CUDA default without speculation); "ngram_sync" with synchronous steps.
    for name, spec, overlap in (("off", None, None), ("ngram", ngram, True), ("ngram_sync", ngram, False)):
        llm = LLM(model=model_dir, load_format="dummy", max_model_len=input_len + output_len + 16,
                  speculative_config=spec, async_scheduling=overlap)
        llm.generate(prompts[:8], params, use_tqdm=False)
        start = time.perf_counter()
        res = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        out[name] = sum(len(r.outputs[0].token_ids) for r in res) / elapsed
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    out["ratio"] = out["ngram"] / out["off"]
    out["ratio_sync"] = out["ngram_sync"] / out["off"]
    return out


COPY_TEXT = ("def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\n"
             "def sub(a, b):\n    return a - b\n\n\ndef div(a, b):\n    return a / b\n")


def copy_speedup(batch_sizes: list[int], output_len: int, k: int,
                 model: str | None = None) -> list[tuple[int, dict[str, float]]]:
    """n-gram speculation on a copying task: output tokens/s without speculation, with n-gram
    speculation under async scheduling and with synchronous steps (the default with speculation),
    and the share of drafted tokens accepted. model: a chat model asked to repeat code (the embedded
    SmolLM2 .gguf, on the GPU machine by file); None: a small random Llama on a repeating prompt, a
    smoke run (its output seldom repeats, so little is accepted)."""
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ferrox import LLM, SamplingParams

    from tests.helpers.tiny_models import make_tiny_llama

    real = model is not None
    if model is None:
        model = make_tiny_llama(tempfile.mkdtemp(prefix="ferrox-spec-"), hidden_size=256, num_layers=4,
                                intermediate_size=512, num_heads=8, num_kv_heads=4)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=not real)
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}
    llms = {name: LLM(model, device="cuda", kv_cache_memory=2 << 30, max_model_len=2048, speculative_config=spec,
                      async_scheduling=overlap)
            for name, spec, overlap in (("off", None, None), ("ngram", ngram, True), ("ngram_sync", ngram, False))}
    rows = []
    for batch in batch_sizes:
        if real:  # a chat model asked to copy text
            tok = next(iter(llms.values())).get_tokenizer()
            ids = tok.encode(tok.apply_chat_template(
                [{"role": "user", "content": "Repeat this text exactly:\n" + COPY_TEXT}], add_generation_prompt=True))
            prompts = [{"prompt_token_ids": list(ids)} for _ in range(batch)]
        else:
            prompts = [{"prompt_token_ids": [40 + i % 7, 41, 42, 43] * 8} for i in range(batch)]
        res: dict[str, float] = {}
        tokens = {}
        for name, llm in llms.items():
            llm.generate(prompts[:1], params, use_tqdm=False)
            before = llm.engine.stats()
            best = 0.0
            for _ in range(3):
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
            after = llm.engine.stats()
            res[name] = best
            if name != "off":  # accepted / drafted tokens over the timed runs
                drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
                accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
                res[f"{name}_accept"] = accepted / max(drafted, 1)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
        res["same_tokens"] = float(tokens["ngram"] == tokens["off"] == tokens["ngram_sync"])
        rows.append((batch, res))
    for llm in llms.values():
        llm.engine.shutdown()
    return rows


def self_draft_ceiling(model_dir: str, ks: list[int], output_len: int) -> list[tuple[str, float]]:
    from ferrox import LLM, SamplingParams

    prompt = bench_setup.random_prompts(1, 128, MAX_ID, seed=2)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    rows = []
    for k in [0, *ks]:
        spec = None if k == 0 else {"method": "draft_model", "model": model_dir, "num_speculative_tokens": k}
        llm = LLM(model=model_dir, load_format="dummy", max_model_len=1024, max_num_seqs=4, speculative_config=spec)
        llm.generate(prompt, params, use_tqdm=False)
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            res = llm.generate(prompt, params, use_tqdm=False)
            best = min(best, (time.perf_counter() - start) / len(res[0].outputs[0].token_ids) * 1e3)
        rows.append(("plain decode" if k == 0 else f"self-draft k={k}", best))
        llm.engine.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--parts", default="verify,ceiling,copy,overhead")
    ap.add_argument("--copy-model", default=None, help="part 4 on this chat model (e.g. the embedded SmolLM2 .gguf) "
                    "asked to copy code, instead of a small random Llama")
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    model_dir = bench_setup.make_model_dir(out_dir="/tmp/bench_spec_8b")
    parts = set(args.parts.split(","))
    print(f"GPU: {torch.cuda.get_device_name()}  model: Llama-3.1-8B dummy (bf16)")
    if "verify" in parts:
        print(f"\n1. verify-step cost, batch 1, context {args.context}")
        print(f"{'step':<34} {'ms':>8} {'x decode':>9}")
        for name, ms, ratio in verify_costs(model_dir, args.context, ks):
            print(f"{name:<34} {ms:>8.3f} {ratio:>9.2f}")
    if "ceiling" in parts:
        print(f"\n3. draft-model ceiling (target as its own draft), batch 1, {args.output_len} tokens")
        rows = self_draft_ceiling(model_dir, ks, args.output_len)
        print(f"{'mode':<20} {'ms/token':>9} {'speed-up':>9}")
        for name, ms in rows:
            print(f"{name:<20} {ms:>9.3f} {rows[0][1] / ms:>9.2f}")
    if "copy" in parts:
        what = args.copy_model or "small random Llama"
        print(f"\n4. copy-heavy output, {what}, n-gram k=4, {args.output_len} tokens per request")
        print(f"{'batch':>5} {'off tok/s':>10} {'ngram async':>12} {'ngram sync':>11} {'async/off':>10} "
              f"{'sync/off':>9} {'accept a/s':>11} {'same':>5}")
        for batch, r in copy_speedup([1, 16], args.output_len, 4, args.copy_model):
            print(f"{batch:>5} {r['off']:>10.0f} {r['ngram']:>12.0f} {r['ngram_sync']:>11.0f} "
                  f"{r['ngram'] / r['off']:>10.2f} {r['ngram_sync'] / r['off']:>9.2f} "
                  f"{r['ngram_accept']:>5.2f}/{r['ngram_sync_accept']:<5.2f} {bool(r['same_tokens'])!s:>5}")
    if "overhead" in parts:
        res = overhead_ratio(model_dir, args.num_prompts, args.input_len, args.output_len, 4)
        print(f"\n2. n-gram on vs off, nothing accepted (random weights), {args.num_prompts} x "
              f"({args.input_len} in, {args.output_len} out), async scheduling unless 'sync'")
        print(f"off {res['off']:.0f} tok/s, ngram k=4 {res['ngram']:.0f} tok/s, ngram k=4 sync "
              f"{res['ngram_sync']:.0f} tok/s (ratio {res['ratio_sync']:.3f})")
        print(f"speculation overhead (ngram/off throughput, target >= 0.95): {res['ratio']:.3f}")


if __name__ == "__main__":
    main()
