"""Kernel warm-up: nothing compiles after the engine reports ready.

A Triton kernel is compiled (or loaded from Triton's on-disk cache, ~/.triton/cache) the first time
a process launches it with a new *specialisation*: its constexprs, the dtypes of its arguments and,
for every integer argument not marked `do_not_specialize`, whether it equals 1 or is a multiple of
16 (pointers: whether they are 16-byte aligned). A step's request count, block-table width and
split-KV count are such integers, so the first prefix-cache hit at a long context, the first batch
of 16 requests, or the first mixed step would each pay a compile (~1 s) inside some request's
latency. The in-memory JIT cache is per process, so even a warm disk cache only spares the
compiler, not the first-launch load.

`warm_up` runs, once per engine, one step of every shape class the scheduler can produce through
the real `ModelRunner` (inputs, forward, logits, sampler), after CUDA-graph capture and before the
engine reports ready:

    fresh prefills      1, 2 and 16 requests (the 1 / other / multiple-of-16 classes) at block-table
                        widths of 1, 3 and 16 blocks
    long prompt         one request of max_num_batched_tokens, then its next chunk
    prefix hits         queries of 2, 64 and 512 tokens over the longest contexts max_model_len allows
                        (~8k: split-KV with many and few splits, and a prefill chunk), 1, 2 and 16
                        requests, widths of both classes
    mixed steps         decodes with a prefill chunk beside them, short and long, with 1, 4 and 15
                        decodes (the row slices a backend takes then start aligned or not)
    sampling            each sampling variant alone in a short prefill
    eager decodes       (only without CUDA graphs; captured graphs already compiled theirs) every
                        count and width class above
    cuDNN plans         where long chunks attend through cuDNN (kernels/cudnn_prefill.py), its plan
                        for every power-of-two chunk and context length bucket they can reach

Each step is scheduled by a throwaway core `Scheduler` with prefix caching on and the engine's own
limits, so its arrays come from the same Rust code as real steps: a context of c tokens is a real
prefix-cache hit on a donor request whose prefill is scheduled but never run (its K/V is whatever
the cache holds: zeros or an earlier warm-up step's, finite either way; the engine's own scheduler
and prefix cache are untouched). The requests of the steps cycle through the sampling variants
(greedy, temperature, top-k/top-p, min-p, seeded, logprobs, prompt logprobs, penalties, logit bias
with allowed tokens and min_tokens), their sampled tokens are counted as the core would accept them,
and every other step applies a grammar bitmask (every fourth through a mask gate, as async
scheduling does), so the first request of each kind also finds the sampler's kernels loaded. Afterwards the blocks the steps wrote
are zeroed and the sampler's default generator is reseeded, so a warmed engine samples exactly what
an unwarmed one would.

`CompileWatch` counts compilations through Triton's JIT hooks (and torch.compile graphs, though
nothing in ferrox uses torch.compile); the warm-up logs what it compiled, and the test
tests/kernels/test_no_compile_after_ready.py asserts that serving first-time shapes compiles nothing.

The engine runs the warm-up on CUDA only (the CPU's torch kernels compile nothing).
FERROX_WARMUP=0 turns it off (start-up A/B measurements); WARMUP_BUDGET_S bounds it (a step
started before the budget runs out finishes; the rest are skipped with a warning).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch

from ferrox import _core
from ferrox.attention.kv_cache import zero_kv_blocks
from ferrox.kernels import nvrtc
from ferrox.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARMUP_ENV = "FERROX_WARMUP"
# Cold, every variant compiles (~1-2 s each for the attention kernels); from Triton's disk cache the
# whole warm-up takes a few seconds. The budget only guards against a pathological start-up.
WARMUP_BUDGET_S = 300.0

# Triton specialises an integer argument on "== 1" and "% 16 == 0": one representative of each class.
REQUEST_COUNTS = (1, 2, 16)
SHORT_WIDTHS = (1, 3, 16)  # block-table widths of short (unsplit) contexts
LONG_QUERY_LENS = (2, 64, 512)  # prefix-hit queries: many KV splits, few, and a chunk for a prefill kernel
# Mixed steps' prefill chunks (~500 tokens, past any cut to a prefill kernel) at block-table widths that
# are odd and a multiple of 4 (see warmup_plan).
MIXED_WIDTHS = (33, 32)
MAX_LONG_WIDTH = 513  # 8k+ contexts: beyond this no split count or width class is new


def warmup_enabled() -> bool:
    """FERROX_WARMUP=0 turns the warm-up off (start-up A/B measurements)."""
    return os.environ.get(WARMUP_ENV, "1") != "0"


# ---- counting compilations -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CompileEvent:
    kernel: str  # the JIT function's name ("torch.compile" for a dynamo graph)
    signature: str  # Triton's description of the variant (argument types and specialisations)
    seconds: float  # compile, or load from the on-disk cache (nan when unknown)


class CompileWatch:
    """Records every kernel compilation while active (a context manager; nests and chains with hooks
    already installed): a Triton JIT miss of the in-memory cache, which compiles or loads from the
    disk cache, a new torch.compile graph, and an NVRTC module built or loaded (kernels/nvrtc.py).

        with CompileWatch() as watch:
            serve(...)
        assert not watch.events, watch.summary()
    """

    def __init__(self) -> None:
        self.events: list[CompileEvent] = []
        self._started: dict[str, float] = {}
        self._holder: Any = None
        self._saved: tuple[Any, Any] = (None, None)
        self._dynamo_graphs = 0

    def __enter__(self) -> CompileWatch:
        self._holder, pre_name, post_name = _jit_hook_slots()
        if self._holder is not None:
            prev_pre, prev_post = getattr(self._holder, pre_name), getattr(self._holder, post_name)
            self._saved = (prev_pre, prev_post)

            def pre(**kwargs: Any) -> Any:
                self._started[str(kwargs.get("key"))] = time.perf_counter()
                # A hook returning True makes Triton skip the compile: pass the previous hook's answer on.
                return prev_pre(**kwargs) if prev_pre is not None else None

            def post(**kwargs: Any) -> Any:
                start = self._started.pop(str(kwargs.get("key")), None)
                fn = kwargs.get("fn")
                info = kwargs.get("compile") or {}
                # The attributes name the specialisations (16-byte alignment / divisibility by argument).
                signature = f"{kwargs.get('repr', '')} attrs={info.get('configs')} constants={info.get('constants')}"
                self.events.append(CompileEvent(
                    kernel=str(getattr(fn, "name", fn)), signature=signature,
                    seconds=time.perf_counter() - start if start is not None else float("nan")))
                return prev_post(**kwargs) if prev_post is not None else None

            setattr(self._holder, pre_name, pre)
            setattr(self._holder, post_name, post)
        self._dynamo_graphs = _dynamo_graph_count()
        nvrtc.add_build_listener(self._nvrtc_built)
        return self

    def _nvrtc_built(self, module: str, seconds: float) -> None:
        self.events.append(CompileEvent(f"nvrtc:{module}", "cubin", seconds))

    def __exit__(self, *exc: object) -> None:
        nvrtc.remove_build_listener(self._nvrtc_built)
        if self._holder is not None:
            _, pre_name, post_name = _jit_hook_slots()
            setattr(self._holder, pre_name, self._saved[0])
            setattr(self._holder, post_name, self._saved[1])
            self._holder = None
        new_graphs = _dynamo_graph_count() - self._dynamo_graphs
        self.events.extend(CompileEvent("torch.compile", "graph", float("nan")) for _ in range(new_graphs))

    @property
    def available(self) -> bool:
        """Whether Triton's hooks could be installed (False without Triton)."""
        return _jit_hook_slots()[0] is not None

    def counts(self) -> Counter[str]:
        return Counter(e.kernel for e in self.events)

    def summary(self) -> str:
        return describe_compiles(self.events)


def describe_compiles(events: list[CompileEvent]) -> str:
    """'compiled N kernels in S s (name xK, ...)' or 'compiled nothing'."""
    if not events:
        return "compiled nothing"
    seconds = sum(e.seconds for e in events if e.seconds == e.seconds)
    kinds = ", ".join(f"{name} x{n}" for name, n in sorted(Counter(e.kernel for e in events).items()))
    return f"compiled {len(events)} kernels in {seconds:.1f} s ({kinds})"


def _jit_hook_slots() -> tuple[Any, str, str]:
    """(object, pre-compile hook attribute, post-compile hook attribute): triton.knobs.runtime from
    Triton 3.4 on, JITFunction's class attributes before it; (None, "", "") without Triton."""
    try:
        from triton import knobs

        if hasattr(knobs.runtime, "jit_cache_hook") and hasattr(knobs.runtime, "jit_post_compile_hook"):
            return knobs.runtime, "jit_cache_hook", "jit_post_compile_hook"
    except ImportError:
        pass
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None, "", ""
    return JITFunction, "cache_hook", "compiled_hook"


def _dynamo_graph_count() -> int:
    # Nothing can have been torch.compiled unless dynamo was imported; importing it here would cost ~1 s.
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


# ---- the plan: one step per shape class -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int  # of the engine's KV cache, null block included
    # The largest decode batch that replays a captured graph (0: none): larger decode steps run eagerly
    # (or through piecewise graphs with eager attention) and are warmed like any other shape class.
    decode_graph_max: int


@dataclass(frozen=True, slots=True)
class RequestShape:
    """One request of a warm-up step: it attends over seq_len positions and computes the last
    query_len of them (query_len == seq_len: a fresh prefill; 1: a decode)."""

    seq_len: int
    query_len: int

    @property
    def is_decode(self) -> bool:
        return self.query_len == 1 and self.seq_len > 1


@dataclass(frozen=True, slots=True)
class Recipe:
    name: str
    requests: tuple[RequestShape, ...]  # decodes first: the scheduler puts running requests first


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def warmup_plan(limits: EngineLimits) -> list[Recipe]:
    """The warm-up steps, most common shape classes first, each within the engine's limits."""
    bs = limits.block_size
    max_seq = limits.max_model_len - 1  # room for one output token
    budget = limits.max_num_batched_tokens
    counts = [n for n in REQUEST_COUNTS if n <= limits.max_num_seqs]
    plan: list[Recipe] = []

    def short_seq(width: int) -> int:  # a sequence whose block table is `width` blocks wide
        return max(2, width * bs - bs // 2)

    def hit(width: int, query: int) -> RequestShape:  # a prefix hit: block-aligned context + query
        return RequestShape((width - _cdiv(query, bs)) * bs + query, query)

    def add(name: str, *requests: RequestShape) -> None:
        # build_step prefills the decode requests' own prompt tokens in one step first: they must fit
        # the budget too (16 decodes of 8 tokens do not fit a 32-token budget).
        decode_prompts = sum(r.seq_len - 1 - _context_hit(r, bs) for r in requests if r.is_decode)
        if (requests and max(r.seq_len for r in requests) <= max_seq and len(requests) <= limits.max_num_seqs
                and sum(r.query_len for r in requests) <= budget and min(r.query_len for r in requests) >= 1
                and decode_prompts <= budget):
            plan.append(Recipe(name, tuple(sorted(requests, key=lambda r: not r.is_decode))))

    for width in SHORT_WIDTHS:
        for n in counts:
            seq = short_seq(width)
            if n * seq <= budget:
                add(f"prefill {n}x{seq}", *[RequestShape(seq, seq)] * n)
            elif width > _cdiv(max(2, budget // n), bs):  # same width, shorter queries over a cached prefix
                add(f"prefill {n}x{seq} (prefix hit)", *[hit(width, max(2, budget // n))] * n)
    chunk = min(budget, max_seq)
    add(f"long prompt {chunk}", RequestShape(chunk, chunk))
    aligned = budget // bs * bs
    add(f"long prompt, next chunk at {aligned}", RequestShape(min(aligned + budget, max_seq),
                                                              min(aligned + budget, max_seq) - aligned))
    long_widths = _long_widths(max_seq // bs)
    for width in long_widths:
        for query in LONG_QUERY_LENS:
            for n in counts:
                shape = hit(width, query)
                add(f"prefix hit {n}x(query {query}, context {shape.seq_len - query})", *[shape] * n)
    # Mixed steps: decodes lead, a prefill chunk follows. A backend may attend the chunk with another
    # kernel on row slices of the step's arrays (seq_lens[d:], block_table[d:]), whose addresses are
    # 16-byte aligned or not (a specialisation) by the number of decodes d and the block-table width.
    mid = short_seq(SHORT_WIDTHS[1])
    add("mixed: decode + prefill", RequestShape(mid, 1), RequestShape(mid, mid))
    many = min(REQUEST_COUNTS[-1], limits.max_num_seqs) - 1
    odd, even = MIXED_WIDTHS
    for n_dec, width in dict.fromkeys(((1, odd), (1, even), (4, even), (many, even))):
        seq = short_seq(width)
        add(f"mixed: {n_dec} decode(s) + prefill {seq}", *[RequestShape(seq, 1)] * n_dec, RequestShape(seq, seq))
    if long_widths:
        shape = hit(long_widths[0], LONG_QUERY_LENS[-1])
        add("mixed: long decode + prefix hit", RequestShape(shape.seq_len, 1), shape)
    eager_counts = [n for n in counts if n > limits.decode_graph_max]
    first_past = limits.decode_graph_max + 1  # the first decode batch past the graphs
    if limits.decode_graph_max and eager_counts and first_past not in eager_counts:
        eager_counts.insert(0, first_past)
    for width in (*SHORT_WIDTHS, *long_widths):
        seq = short_seq(width) if width in SHORT_WIDTHS else width * bs - 1
        for n in eager_counts:
            add(f"decode {n}x{seq}", *[RequestShape(seq, 1)] * n)
    return plan


def _long_widths(max_width: int) -> list[int]:
    """The widest block tables of each class (a multiple of 16 and not) up to MAX_LONG_WIDTH, as long
    as they reach split-KV contexts (>= 32 blocks); longer contexts only raise the split count."""
    cap = min(max_width, MAX_LONG_WIDTH)
    multiple = cap // 16 * 16
    other = cap if cap % 16 else cap - 1
    return [w for w in (multiple, other) if w >= 32]


# ---- building a step with the core scheduler ---------------------------------------------------------
_PREFIX_TOKEN = 1  # the donor's (shared) prefix; each request's own tokens differ from it and each other


@dataclass(slots=True)
class WarmupStep:
    so: Any  # ferrox._core.SchedulerOutput of the recipe's step
    prompts: list[list[int]]  # per row of `so` (batch order): the request's prompt
    num_blocks: int  # blocks (null included) the step's scheduler used: every block id lies below


def _context_hit(r: RequestShape, block_size: int) -> int:
    """Tokens of the request served from the donor's cached blocks."""
    if r.is_decode:  # its prompt is seq_len - 1 tokens, of which the core computes at least one
        return (r.seq_len - 2) // block_size * block_size
    return r.seq_len - r.query_len


def build_step(recipe: Recipe, limits: EngineLimits, vocab_size: int) -> WarmupStep:
    """Schedule `recipe` with a throwaway core Scheduler (prefix caching on, the engine's limits):
    a donor request's prefill (scheduled, never run) puts the shared context in the prefix cache,
    decode requests are prefilled and sampled once, then the step itself is scheduled. Raises
    RuntimeError if the core scheduled something else."""
    bs = limits.block_size
    hits = [_context_hit(r, bs) for r in recipe.requests]
    if any(h % bs for h in hits):
        raise ValueError(f"warm-up step {recipe.name!r}: a cached context must be whole blocks, got {hits}")
    donor = max(hits, default=0)
    # The null block, the donor's blocks, each request's blocks past its cached context, and one spare.
    own = sum(_cdiv(r.seq_len, bs) - h // bs for r, h in zip(recipe.requests, hits, strict=True))
    num_blocks = 2 + donor // bs + own
    sched = _core.Scheduler(num_blocks=num_blocks, max_model_len=limits.max_model_len, block_size=bs,
                            max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens,
                            enable_prefix_caching=True)

    def add(name: str, prompt: list[int], max_tokens: int) -> None:
        sched.add_request(name, np.asarray(prompt, dtype=np.int64), max_tokens=max_tokens, ignore_eos=True,
                          detokenize=False)

    def sample_all(so: Any) -> None:
        sched.update_from_output(np.full(so.num_reqs, _PREFIX_TOKEN, dtype=np.int64))

    if donor:
        add("donor", [_PREFIX_TOKEN] * donor, max_tokens=1)
        while sched.has_unfinished_requests():  # chunked when longer than the token budget
            sample_all(sched.schedule())
    prompts: dict[str, list[int]] = {}
    for i, (r, h) in enumerate(zip(recipe.requests, hits, strict=True)):
        own = (2 + i) % vocab_size
        prompt_len = r.seq_len - 1 if r.is_decode else r.seq_len
        prompts[f"warmup-{i}"] = [_PREFIX_TOKEN] * h + [own] * (prompt_len - h)
    decodes = [f"warmup-{i}" for i, r in enumerate(recipe.requests) if r.is_decode]
    for rid in decodes:
        add(rid, prompts[rid], max_tokens=4)
    if decodes:
        so = sched.schedule()
        if list(so.req_ids) != decodes or not np.asarray(so.sample_mask).all():
            raise RuntimeError(f"warm-up step {recipe.name!r}: its decode requests were not prefilled in one step")
        sample_all(so)
    for i, r in enumerate(recipe.requests):
        if not r.is_decode:
            add(f"warmup-{i}", prompts[f"warmup-{i}"], max_tokens=1)
    so = sched.schedule()
    got = list(zip(np.asarray(so.seq_lens).tolist(), np.asarray(so.num_scheduled_tokens).tolist(), strict=True))
    want = [(r.seq_len, r.query_len) for r in recipe.requests]
    if got != want:
        raise RuntimeError(f"warm-up step {recipe.name!r} was scheduled as (seq_len, query_len) {got}, not {want}")
    return WarmupStep(so, [prompts[rid] for rid in so.req_ids], num_blocks)


# ---- running the steps ---------------------------------------------------------------------------
def sampling_variants(vocab_size: int) -> list[SamplingParams]:
    """One request of each kind the sampler treats differently, one with everything an API request
    commonly sets at once, and last one asking for prompt logprobs (given only to short fresh prompts)."""
    low = list(range(1, min(vocab_size, 9)))
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.0, top_p=0.95, seed=0),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1),
        SamplingParams(temperature=1.0, logit_bias={low[0]: 2.0}, allowed_token_ids=low, min_tokens=2),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, logprobs=5, repetition_penalty=1.1,
                       presence_penalty=0.2, frequency_penalty=0.1, logit_bias={low[0]: 1.0}),
        SamplingParams(temperature=0.0, prompt_logprobs=2),
    ]


_PROMPT_LOGPROBS_MAX_LEN = 512
SAMPLING_PROMPT_LEN = 40


def _grammar_bitmask(step_index: int, num_reqs: int, vocab_size: int) -> torch.Tensor | None:
    """Every other step: the first row (every row, every fourth step) allowed only the lowest tokens,
    as a grammar would (llguidance's packed layout; all ones = unconstrained)."""
    if step_index % 2 == 0:
        return None
    words = (vocab_size + 31) // 32
    mask = np.full((num_reqs, words), -1, dtype=np.int32)
    rows = slice(None) if step_index % 4 == 3 else slice(0, 1)
    mask[rows, max(1, words // 2):] = 0
    return torch.from_numpy(mask)


@dataclass(slots=True)
class WarmupReport:
    seconds: float = 0.0
    steps: list[str] = field(default_factory=list)  # recipe names, in the order run
    skipped: list[str] = field(default_factory=list)  # recipe names not run, with why
    compiled: list[CompileEvent] = field(default_factory=list)
    cudnn_plans: int = 0  # cuDNN attention plans built for long prefill chunks (kernels/cudnn_prefill.py)

    def summary(self) -> str:
        text = f"{len(self.steps)} steps in {self.seconds:.1f} s, {describe_compiles(self.compiled)}"
        if self.cudnn_plans:
            text += f", {self.cudnn_plans} cuDNN attention plans"
        return text + (f"; skipped {len(self.skipped)}" if self.skipped else "")


def warm_up(runner: Any, limits: EngineLimits, *, vocab_size: int, seed: int,
            budget_s: float = WARMUP_BUDGET_S) -> WarmupReport:
    """Run every recipe of `warmup_plan(limits)`, then each sampling variant alone, through `runner`
    (a ModelRunner whose KV cache has limits.num_blocks blocks and holds no request). Leaves no
    trace: the requests leave the runner, the blocks the steps wrote are zeroed, and the sampler's
    default generator restarts from `seed`."""
    report = WarmupReport()
    if not warmup_enabled():
        report.skipped.append(f"all ({WARMUP_ENV}=0)")
        return report
    start = time.perf_counter()
    variants = sampling_variants(vocab_size)
    touched: set[int] = set()
    next_variant = 0
    # The shape classes, their requests cycling through the variants; then each variant alone.
    jobs: list[tuple[Recipe, SamplingParams | None]] = [(recipe, None) for recipe in warmup_plan(limits)]
    jobs += _sampling_recipes(limits, variants)
    with CompileWatch() as watch:
        for index, (recipe, forced) in enumerate(jobs):
            if time.perf_counter() - start > budget_s:
                report.skipped.append(f"{recipe.name} (past the {budget_s:.0f} s budget)")
                continue
            step = build_step(recipe, limits, vocab_size)
            if step.num_blocks > limits.num_blocks:
                report.skipped.append(f"{recipe.name} (needs {step.num_blocks} KV blocks)")
                continue
            params = [forced or _variant_for(r, variants, next_variant + i) for i, r in enumerate(recipe.requests)]
            next_variant += len(params)
            _run_step(runner, step, params, _grammar_bitmask(index, len(params), vocab_size), index)
            touched.update(np.unique(np.asarray(step.so.block_table)).tolist())
            report.steps.append(recipe.name)
            logger.debug("warm-up step %r done at %.2f s", recipe.name, time.perf_counter() - start)
        # After the steps, which decided whether long chunks go to cuDNN: its plan for every
        # length bucket a chunk can reach (a plan is ~80 ms to build on the H200).
        backend = getattr(getattr(runner, "model", None), "backend", None)
        if backend is not None and hasattr(backend, "warm_up_plans"):
            report.cudnn_plans = backend.warm_up_plans(limits.max_num_batched_tokens, limits.max_model_len)
    _forget_steps(runner, touched, seed)
    report.compiled = watch.events
    report.seconds = time.perf_counter() - start
    if report.skipped:
        logger.warning("warm-up skipped %d steps (their first requests may compile kernels): %s",
                       len(report.skipped), "; ".join(report.skipped))
    return report


def _sampling_recipes(limits: EngineLimits, variants: list[SamplingParams]) -> list[tuple[Recipe, SamplingParams]]:
    """Each sampling variant alone in a short one-request prefill: the first request of a kind finds
    its sampler path run once at batch 1 (the shape steps mix kinds in batches)."""
    seq = min(SAMPLING_PROMPT_LEN, limits.max_model_len - 1, limits.max_num_batched_tokens)
    if seq < 1:
        return []
    shape = (RequestShape(seq, seq),)
    return [(Recipe(f"sampling {msgspec.json.encode(p).decode()}", shape), p) for p in variants]


def _variant_for(r: RequestShape, variants: list[SamplingParams], k: int) -> SamplingParams:
    """The k-th request's sampling variant (cycling), except that prompt logprobs go only to short
    fresh prompts: they score a prompt from its first token, and a long one's [len, vocab] logits
    would be a needless spike of memory."""
    p = variants[k % len(variants)]
    if p.prompt_logprobs is not None and (r.query_len != r.seq_len or r.seq_len > _PROMPT_LOGPROBS_MAX_LEN):
        return variants[0]
    return p


def _run_step(runner: Any, step: WarmupStep, params: list[SamplingParams], bitmask: torch.Tensor | None,
              index: int) -> None:
    slots = np.asarray(step.so.req_slots, dtype=np.int32)
    added: list[int] = []
    try:
        for slot, prompt, p in zip(slots.tolist(), step.prompts, params, strict=True):
            runner.add_request(slot, f"warmup-{index}-{slot}", prompt, p)
            added.append(slot)
        mask: Any = bitmask
        if bitmask is not None and index % 4 == 1 and getattr(runner, "can_gate_masks", False):
            mask = _through_gate(runner, bitmask)  # the engine's path under async scheduling on CUDA
        out = runner.execute(step.so, mask)
        # The core accepts every sampled token: count them as it would (penalties, min_tokens), so the
        # first such request does not pay for that path's first run either.
        rows = np.flatnonzero(np.asarray(step.so.sample_mask))
        runner.append_accepted(slots[rows], out.sampled_token_ids[rows].astype(np.int32),
                               np.arange(rows.size + 1, dtype=np.int32))
    finally:
        runner.remove_requests(np.asarray(added, dtype=np.int32))


def _through_gate(runner: Any, bitmask: torch.Tensor) -> Any:
    """The mask's constrained rows behind a mask gate (worker/mask_gate.py), filled and released at
    once, so that the gate's wait kernel compiles here too."""
    words = bitmask.numpy()
    rows = np.flatnonzero((words != -1).any(axis=1))
    pending = runner.open_mask_gate(rows, words.shape[1])
    pending.host.copy_(torch.from_numpy(words[rows]))
    pending.release()
    return pending


def _forget_steps(runner: Any, blocks: set[int], seed: int) -> None:
    """Zero the KV blocks the warm-up wrote (as CUDA-graph capture does with its own) and restart the
    sampler's default generator, so that the first real requests see a fresh engine. (Other
    tensor-parallel ranks keep the finite K/V of these steps in their copies of those blocks; no
    request reads a slot before writing it.)"""
    blocks.discard(0)
    if blocks:
        ids = torch.tensor(sorted(blocks), dtype=torch.int64, device=runner.kv_caches[0].device)
        with torch.inference_mode():
            zero_kv_blocks(runner.kv_caches, ids)
    if getattr(runner, "state_rows", None) is not None:
        runner.state_rows.reset()  # (a hybrid model's rows the warm-up requests took: worker/recurrent_states.py)
    generator = runner.sampler.default_generator
    if generator is not None:
        generator.manual_seed(seed)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
