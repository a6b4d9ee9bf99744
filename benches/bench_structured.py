"""Structured output overhead: constrained vs. free decoding on the same workload.

    .venv/bin/python benches/bench_structured.py [--requests 32] [--max-tokens 128] [--reps 2]

Workload: --requests chat prompts asking for a JSON record, run through the offline `LLM` on
the embedded SmolLM2 (CPU by default). The constrained run decodes each under a JSON schema
(temperature 1, per-request seeds); the free run then decodes the same prompts with
`ignore_eos` and each request's max_tokens set to the token count its constrained twin
produced, so both runs compute exactly the same number of prompt and output tokens. The prefix
cache is reset before every timed run; the schema's compiled grammar is warm (as in steady
serving); the cost of a *new* schema is measured separately as the time to first token of one
request with a never-seen schema, next to the same request unconstrained.

Output tok/s = output tokens / wall time. Prints `structured_over_free: <ratio>` last
(constrained tok/s over free tok/s; target >= 0.85).

--mix: the issue-10 workload instead: a quarter of the requests JSON-schema constrained, an eighth
with logprobs=5, an eighth with repetition/frequency penalties, the rest plain, all in one batch
(with async scheduling on, as on a GPU by default, none of them may switch the engine to
synchronous steps), against the same prompts all plain with the same token counts.
--model PATH --load-format dummy runs a real architecture with random weights (the GPU run:
benches/bench_setup.py's Llama-3.1-8B folder).
"""

from __future__ import annotations

import argparse
import time
import uuid

from ferrox import LLM, SamplingParams
from ferrox import StructuredOutputsParams as P

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org|net)$"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "country": {"enum": ["France", "Germany", "Spain", "Italy", "Other"]},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4},
    },
    "required": ["name", "age", "email", "address", "tags"],
    "additionalProperties": False,
}


def prompts(n: int) -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"Invent customer number {i} and describe them as a JSON record."}]
        for i in range(n)
    ]


def timed(llm: LLM, convs: list, params: list[SamplingParams]) -> tuple[float, list[int]]:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [len(o.outputs[0].token_ids) for o in outs]


def free_twins(lengths: list[int]) -> list[SamplingParams]:
    """Unconstrained params producing exactly the given number of tokens per request."""
    return [
        SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)
    ]


def ttft(llm: LLM, params: SamplingParams) -> float:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.chat(
        [{"role": "user", "content": "A JSON record, please."}], params.clone(max_tokens=1), use_tqdm=False
    )
    return time.perf_counter() - start


MIX_KINDS = ("json", "logprobs", "penalties")


def mixed(n: int, max_tokens: int, kinds: tuple[str, ...] = MIX_KINDS) -> list[SamplingParams]:
    """A quarter JSON schema, an eighth logprobs, an eighth penalties, the rest plain (a kind left
    out of `kinds` stays plain)."""
    out = []
    for i in range(n):
        slot = i % 8
        base = SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens)
        if slot in (0, 1) and "json" in kinds:
            out.append(base.clone(structured_outputs=P(json=SCHEMA)))
        elif slot == 2 and "logprobs" in kinds:
            out.append(base.clone(logprobs=5))
        elif slot == 3 and "penalties" in kinds:
            out.append(base.clone(repetition_penalty=1.2, frequency_penalty=0.3))
        else:
            out.append(base)
    return out


class StepCounter:
    """Counts engine steps and their wall time during a run (where the time goes)."""

    def __init__(self, engine) -> None:
        self.inner, self.n, self.seconds = engine.step, 0, 0.0
        engine.step = self

    def __call__(self):
        start = time.perf_counter()
        try:
            return self.inner()
        finally:
            self.n += 1
            self.seconds += time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2, help="timed repetitions of each run (best is kept)")
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--mix", action="store_true", help="the mixed workload (see above)")
    parser.add_argument("--ab-mask-thread", action="store_true",
                        help="run each --mix-sets row also with the grammar masks filled inline (the engine's "
                             "fill_masks_in_background off), in the same process")
    parser.add_argument("--mix-sets", default=None,
                        help="also time these kind sets one by one (';'-separated, e.g. 'json;logprobs;penalties')")
    args = parser.parse_args()

    llm = LLM(args.model, load_format=args.load_format)
    convs = prompts(args.requests)
    constrained = mixed(args.requests, args.max_tokens) if args.mix else [
        SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=P(json=SCHEMA))
        for i in range(args.requests)
    ]
    # Warm-up: compiles the schema, touches every kernel path once.
    _, lengths = timed(llm, convs, constrained)
    timed(llm, convs, free_twins(lengths))

    steps = StepCounter(llm.engine)
    runs = [(kinds, True) for kinds in (args.mix_sets.split(";") if args.mix_sets else [])]
    if args.ab_mask_thread:  # each set with the grammar masks filled on the engine thread, then beside it
        runs = [(kinds, thread) for kinds, _ in runs for thread in (False, True)]
    for kinds, thread in runs:
        llm.engine.fill_masks_in_background = thread
        params = mixed(args.requests, args.max_tokens, tuple(kinds.split(",")))
        _, lengths = timed(llm, convs, params)  # warm-up
        steps.n, steps.seconds = 0, 0.0
        t_c, lengths = timed(llm, convs, params)
        n_c, s_c = steps.n, steps.seconds
        steps.n, steps.seconds = 0, 0.0
        t_f, _ = timed(llm, convs, free_twins(lengths))
        kinds = kinds if thread else f"{kinds} (mask inline)"
        print(f"kinds {kinds:<24} ratio {t_f / t_c:.3f}  steps {n_c} vs {steps.n}  "
              f"step ms {1e3 * s_c / max(n_c, 1):.2f} vs {1e3 * steps.seconds / max(steps.n, 1):.2f}")
    llm.engine.fill_masks_in_background = True
    tps_c = tps_f = 0.0
    total = 0
    for _ in range(args.reps):  # alternate so that machine noise hits both runs alike
        t_c, lengths = timed(llm, convs, constrained)
        t_f, got = timed(llm, convs, free_twins(lengths))
        assert got == lengths, "free twins must produce exactly their max_tokens"
        total = sum(lengths)
        tps_c, tps_f = max(tps_c, total / t_c), max(tps_f, total / t_f)

    new_schema = dict(
        SCHEMA, properties=dict(SCHEMA["properties"], **{f"id_{uuid.uuid4().hex[:8]}": {"type": "integer"}})
    )
    new_schema["required"] = [
        *SCHEMA["required"],
        *[k for k in new_schema["properties"] if k.startswith("id_")],
    ]
    ttft_new = ttft(llm, SamplingParams(temperature=0, structured_outputs=P(json=new_schema)))
    ttft_cached = ttft(llm, SamplingParams(temperature=0, structured_outputs=P(json=new_schema)))
    ttft_free = ttft(llm, SamplingParams(temperature=0))

    print(f"requests: {args.requests}  output tokens per run: {total}  (mean {total / len(lengths):.1f})"
          f"  async scheduling: {llm.engine.async_scheduling}  device: {llm.engine.device}")
    label = "mixed (json/logprobs/penalties)" if args.mix else "constrained (json schema)"
    print(f"{label}: {tps_c:.1f} output tok/s (best of {args.reps})")
    print(f"free (same token counts):  {tps_f:.1f} output tok/s (best of {args.reps})")
    print(
        f"ttft new schema: {ttft_new * 1000:.0f} ms  cached schema: {ttft_cached * 1000:.0f} ms  free: {ttft_free * 1000:.0f} ms"
    )
    print(f"{'mixed_over_plain' if args.mix else 'structured_over_free'}: {tps_c / tps_f:.3f}")


if __name__ == "__main__":
    main()
