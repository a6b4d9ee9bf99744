"""N-gram speculative decoding vs plain decoding, side by side in one run: CPU, the embedded
SmolLM2-135M, one stream at a time, copy-heavy prompts (repeat a text, edit a code block).

    .venv/bin/python benches/bench_spec.py [--k 4] [--max-tokens 256] [--threads N]

Each prompt is decoded greedily by both engines (same weights, same settings but speculative_config),
after one warm-up request each, alternating, best of --repeat runs; the outputs must be identical token
for token, except where float32 rounding flips a near-tie (explain_divergence checks that it is one). Prints per-prompt
tok/s, the acceptance statistics, and last the speed-up (target >= 1.5x)."""

from __future__ import annotations

import argparse
import time

from ferrox import LLM, SamplingParams

CODE = '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out
'''
TEXT = ("The paged KV cache splits each sequence's keys and values into fixed-size blocks. A block table "
        "maps every logical block of a request to a physical block, so memory is allocated on demand and "
        "shared prefixes are stored once. When blocks run out, the scheduler preempts a request and "
        "recomputes it later, so no output is lost.")
PROMPTS = [
    [{"role": "user", "content": "Repeat this text exactly, word for word:\n\n" + TEXT}],
    [{"role": "user", "content": "Rename the function merge_sorted to merge and print the whole code:\n\n" + CODE}],
    [{"role": "user", "content": "Add type hints to this function and print the whole code:\n\n" + CODE}],
]


def timed(llm: LLM, prompt: list[dict[str, str]], sp: SamplingParams) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = llm.chat(prompt, sp, use_tqdm=False)[0].outputs[0]
    return out.token_ids, time.perf_counter() - start


def explain_divergence(plain: LLM, prompt: list[dict[str, str]], ref: list[int], out: list[int]) -> str:
    """Speculation verifies 1 + k positions in one forward pass, plain decoding one: float32 rounding
    differs in the last bits (as it does between thread counts), which flips an argmax only where the
    top two logits tie to ~1e-4. Anything else is a bug: raise."""
    j = next((i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), min(len(ref), len(out)))
    if j >= min(len(ref), len(out)):
        raise AssertionError(f"speculative output differs in length only ({len(out)} vs {len(ref)} tokens)")
    scored = plain.chat(prompt, SamplingParams(temperature=0.0, max_tokens=j + 1, logprobs=5), use_tqdm=False)
    top = scored[0].outputs[0].logprobs[j]  # type: ignore[index]
    if out[j] not in top or ref[j] not in top or top[ref[j]].logprob - top[out[j]].logprob > 1e-3:
        raise AssertionError(f"speculative output differs from plain greedy output at token {j}, not at a tie")
    return f"token {j} (logprob gap {top[ref[j]].logprob - top[out[j]].logprob:.1e})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    ap.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=2, help="runs per prompt and engine (the best counts)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (num_threads)")
    args = ap.parse_args()
    common = dict(max_model_len=2048, kv_cache_memory=256 << 20, num_threads=args.threads)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    plain = LLM(**common)
    spec = LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": args.k,
                                             "prompt_lookup_min": args.lookup_min,
                                             "prompt_lookup_max": args.lookup_max})
    for llm in (plain, spec):  # warm-up
        llm.chat(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    before = spec.engine.stats()
    ref_tokens, ref_s, spec_s, notes = [], [], [], []
    spec_lens: list[int] = []
    # One stream at a time; the two engines alternate and each keeps its best of --repeat runs, so a
    # load change on a shared machine hits both alike.
    for prompt in PROMPTS:
        best = {"plain": float("inf"), "ngram": float("inf")}
        for _ in range(args.repeat):
            ref, t_plain = timed(plain, prompt, sp)
            out, t_spec = timed(spec, prompt, sp)
            if out != ref:
                notes.append(explain_divergence(plain, prompt, ref, out))
            best["plain"], best["ngram"] = min(best["plain"], t_plain), min(best["ngram"], t_spec)
        ref_tokens.append(ref)
        spec_lens.append(len(out))
        ref_s.append(best["plain"])
        spec_s.append(best["ngram"])
    after = spec.engine.stats()
    print(f"{'prompt':>6} {'tokens':>6} {'plain tok/s':>11} {'ngram tok/s':>11} {'speed-up':>8}")
    for i, toks in enumerate(ref_tokens):
        a, b = len(toks) / ref_s[i], spec_lens[i] / spec_s[i]  # (after a near-tie the lengths may differ)
        print(f"{i:>6} {len(toks):>6} {a:>11.1f} {b:>11.1f} {b / a:>7.2f}x")
    plain_rate, spec_rate = sum(len(t) for t in ref_tokens) / sum(ref_s), sum(spec_lens) / sum(spec_s)
    drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
    draft_tokens = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    print(f"k={args.k}, prompt lookup {args.lookup_min}..{args.lookup_max} (all runs): {drafts} verify steps, {accepted}/{draft_tokens} draft tokens accepted "
          f"({100 * accepted / max(draft_tokens, 1):.0f}%), mean acceptance length {1 + accepted / max(drafts, 1):.2f}")
    print("outputs identical: " + ("yes" if not notes else "up to float32 near-ties: " + "; ".join(notes)))
    print(f"all prompts: plain {plain_rate:.1f} tok/s, ngram {spec_rate:.1f} tok/s, "
          f"speed-up {spec_rate / plain_rate:.2f}x")


if __name__ == "__main__":
    main()
