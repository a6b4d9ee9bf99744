"""The sampler: logits [B, V] -> one token per row, on the logits' device.

Order, as in vLLM: raw logprobs (if asked) -> penalties, logit_bias, token masks, min_tokens ->
greedy rows take the argmax -> random rows: temperature, min-p, top-k/top-p, then a draw.

The draw is the exponential race: with q ~ Exp(1) per token, argmax(p / q) is distributed as p.
Each seeded request owns a `torch.Generator` and consumes exactly one Exp(1) vector per sampled
step, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ferrox.config import LOGPROBS_MODES
from ferrox.kernels import cuda_sampling
from ferrox.layers import logits_processors as lp


@dataclass(slots=True)
class PenaltyInputs:
    rows: torch.Tensor  # [R] int64
    prompt_mask: torch.Tensor  # [R, V] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [R, V] float32: occurrences in the output so far
    repetition: torch.Tensor  # [R]
    frequency: torch.Tensor  # [R]
    presence: torch.Tensor  # [R]


@dataclass(slots=True)
class SamplingMetadata:
    """Everything per-row the sampler needs; built by the model runner (cached while the batch
    composition does not change). Optional parts are None when no row uses them."""

    all_greedy: bool
    greedy_rows: torch.Tensor | None = None  # [B] bool; None when all rows are random or all greedy
    temperature: torch.Tensor | None = None  # [B] float32 (1.0 on greedy rows); None if all greedy
    top_k: torch.Tensor | None = None  # [B] int64, vocab size = off
    top_k_max: int | None = None  # the largest top_k of the rows that use one (a bound known on the host)
    top_p: torch.Tensor | None = None  # [B] float32, 1.0 = off
    min_p: torch.Tensor | None = None  # [B] float32, 0.0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    # On CUDA, the same seeded rows' draws by (seed, counter) in one launch (kernels/seeded_uniforms.py).
    seeded: SeededDraws | None = None
    # None: no row wants sample logprobs; else the top-N width for the rows that asked for the top
    # alternatives (each row keeps its own N of them).
    max_num_logprobs: int | None = None
    # [B, M] int64 when some row names its alternatives (vLLM's logprob_token_ids): those rows' ids,
    # padded by repeating the first; -1 across the rows that take the top-N instead.
    logprob_token_ids: torch.Tensor | None = None
    penalties: PenaltyInputs | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, biases
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # rows [R], mask [R, V] bool
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, token ids set to -inf
    # rows, token ids set to -inf where the bool [N] holds (a condition computed on the device)
    banned_if: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # The user's --logits-processors over the whole batch, after the built-in ones (worker/custom_logits.py).
    custom: Callable[[torch.Tensor], torch.Tensor] | None = None


def seed_bits(seed: int) -> int:
    """A request seed (any Python int, as torch.Generator.manual_seed takes) as an int64 bit pattern."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass(slots=True)
class SeededDraws:
    """The seeded rows of a step (the keys of SamplingMetadata.generators, ascending), int64 [S] on
    the device: the row, its request's seed bits, how many steps the request has sampled before."""

    rows: torch.Tensor
    seeds: torch.Tensor
    counters: torch.Tensor

    def renumbered(self) -> SeededDraws:
        """The same draws for a sub-batch holding just these rows, in order."""
        rows = torch.arange(self.rows.numel(), dtype=torch.int64, device=self.rows.device)
        return SeededDraws(rows, self.seeds, self.counters)


@dataclass(slots=True)
class LogprobsTensors:
    token_logprobs: torch.Tensor  # [B] logprob of the sampled token
    token_ranks: torch.Tensor  # [B] its 1-based rank
    top_token_ids: torch.Tensor  # [B, N]
    top_logprobs: torch.Tensor  # [B, N]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int,
                     named: torch.Tensor | None = None, *, normalize: bool = True) -> LogprobsTensors:
    """Logprobs of `token_ids` and of each row's alternatives from logits [B, V]: the top `num_top`,
    or on the rows of `named` ([B, M], SamplingMetadata.logprob_token_ids) that name ids, those ids'
    own logprobs in the order given. The width is max(num_top, M); the host keeps each row's share.
    normalize=False: the logits' own values (the *_logits modes; the same order, so the same ranks)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1) if normalize else logits.float()
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_top > 0:
        top = torch.topk(logprobs, num_top, dim=-1)
        top_ids, top_lp = top.indices, top.values
    else:
        top_ids = torch.empty((logits.shape[0], 0), dtype=torch.int64, device=logits.device)
        top_lp = torch.empty((logits.shape[0], 0), dtype=torch.float32, device=logits.device)
    if named is not None:
        width = max(num_top, named.shape[1])
        # Columns past a row's own share hold token 0: gathered, then dropped on the host.
        top_ids = torch.nn.functional.pad(top_ids, (0, width - num_top))
        named = torch.nn.functional.pad(named, (0, width - named.shape[1]), value=0)
        names = (named[:, :1] >= 0)
        top_ids = torch.where(names, named, top_ids)
        top_lp = logprobs.gather(1, top_ids)
    return LogprobsTensors(chosen.squeeze(1), ranks, top_ids, top_lp)


def processed_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits a draw sees, from logits the processors already edited (penalties, bias, masks): on
    random rows divided by the temperature, then min-p and top-k/top-p (dropped tokens -inf), as the
    sampler applies them; greedy rows (temperature 1, no truncation) unchanged. A new tensor unless
    every row is greedy."""
    if md.all_greedy:
        return logits
    assert md.temperature is not None
    scaled = logits / md.temperature.unsqueeze(1)
    if md.min_p is not None:
        scaled = lp.apply_min_p(scaled, md.min_p)
    if md.top_k is not None or md.top_p is not None:
        scaled = lp.apply_top_k_top_p(scaled, md.top_k, md.top_p, md.top_k_max)
    return scaled


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax. A few rows of a large vocabulary on CUDA take the split-row kernel
    (kernels/argmax.py), where it measured faster than torch's reduction on an H200 (GPU time,
    us, torch / kernel: 128,256 logits, 1 row 26.2 / 5.1, 8 rows 26.8 / 5.5; 151,936: 8.6 / 8.8
    and 10.4 / 9.0); torch's otherwise (32,000 logits: 8.9 / 12.0; 256 rows of 151,936:
    54.5 / 71.3). A short decode step waits for this; a step of many rows hardly notices it."""
    rows, vocab = logits.shape[0], logits.shape[-1]
    if logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1 and rows <= 8 and vocab >= 65536:
        from ferrox.kernels.argmax import argmax_rows

        return argmax_rows(logits)
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, default_generator: torch.Generator | None = None, top_k_top_p_kernel: Any | None = None,
                 logprobs_mode: str = "raw_logprobs") -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        # Unseeded random rows draw from this one generator (seeded from the engine's seed, so
        # whole runs reproduce too).
        self.default_generator = default_generator
        # cuda/top_k_top_p_sampling.cu when the engine chose it at start (cuda_sampling.prepare_extension),
        # fixed for the sampler's life so a seeded request always draws through the same path.
        self.top_k_top_p_kernel = top_k_top_p_kernel

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        scored = self.process(logits, md)
        if md.all_greedy:
            token_ids = greedy(logits)
        else:
            token_ids = self._sample_random(logits, md)
            if md.greedy_rows is not None:
                token_ids = torch.where(md.greedy_rows, greedy(logits), token_ids)
        logprobs = None
        if scored is not None:
            logprobs = self.logprobs(scored, token_ids, md)
        return SamplerOutput(token_ids, logprobs)

    def process(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor | None:
        """Apply the logits processors to `logits` in place; return the logits the logprobs mode reads
        (a copy of the raw ones, or processed_logits), or None when no row wants logprobs."""
        want = md.max_num_logprobs is not None
        scored = logits.clone() if want and self.logprobs_mode.startswith("raw") else None
        self.apply_logits_processors(logits, md)
        if want and scored is None:
            scored = processed_logits(logits, md)
        return scored

    @property
    def normalized(self) -> bool:
        """Whether reported values are log-softmaxed (the *_logprobs modes) or the logits as they are."""
        return self.logprobs_mode.endswith("logprobs")

    def logprobs(self, scored: torch.Tensor, token_ids: torch.Tensor, md: SamplingMetadata) -> LogprobsTensors:
        """The reported logprobs from the logits the mode reads (Sampler.process)."""
        return compute_logprobs(scored, token_ids, md.max_num_logprobs or 0, md.logprob_token_ids,
                                normalize=self.normalized)

    @staticmethod
    def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> None:
        if md.penalties is not None:
            p = md.penalties
            lp.apply_penalties(
                logits, p.rows, p.prompt_mask, p.output_counts, p.repetition, p.frequency, p.presence
            )
        if md.logit_bias is not None:
            lp.apply_logit_bias(logits, *md.logit_bias)
        if md.allowed is not None:
            lp.apply_token_mask(logits, *md.allowed)
        if md.banned is not None:
            lp.apply_banned_tokens(logits, *md.banned)
        if md.banned_if is not None:
            lp.apply_banned_tokens_if(logits, *md.banned_if)
        if md.custom is not None:
            md.custom(logits)  # (in place)

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        assert md.temperature is not None
        top_cut = md.top_k is not None or md.top_p is not None
        if logits.is_cuda and not top_cut:
            # One Triton pass (kernels/exponential_race.py) instead of ~14 torch passes over [B, V].
            from ferrox.kernels.exponential_race import exponential_race

            temperature = md.temperature
            if md.min_p is not None:
                logits = lp.apply_min_p(logits / temperature.unsqueeze(1), md.min_p)
                temperature = torch.ones_like(temperature)
            return exponential_race(logits, temperature, self._uniforms(logits, md.generators, md.seeded))
        logits = logits / md.temperature.unsqueeze(1)
        if md.min_p is not None:
            logits = lp.apply_min_p(logits, md.min_p)
        if top_cut and logits.is_cuda and self.top_k_top_p_kernel is not None and len(md.generators) < logits.shape[0]:
            tokens = self._sample_top_k_top_p_cuda(logits, md)
            if md.generators:
                # Seeded rows keep the exponential race below. Its draw barely moves under the
                # last-bit logit differences that a different batch shape causes in bf16, so a
                # seeded request gives the same tokens alone or batched; the kernel's inverse-CDF
                # draw moves whenever its uniform lands near a CDF step (seen on the H200).
                rows = sorted(md.generators)
                # From pinned memory without blocking (a blocking copy would wait for the step
                # launched after this one under async scheduling).
                idx = torch.tensor(rows).pin_memory().to(logits.device, non_blocking=True)
                top_k = None if md.top_k is None else md.top_k.index_select(0, idx)
                top_p = None if md.top_p is None else md.top_p.index_select(0, idx)
                seeded = lp.apply_top_k_top_p(logits.index_select(0, idx), top_k, top_p, md.top_k_max)
                tokens.index_copy_(0, idx, self._race(seeded, {i: md.generators[r] for i, r in enumerate(rows)},
                                                      md.seeded.renumbered() if md.seeded is not None else None))
            return tokens
        if top_cut:
            logits = lp.apply_top_k_top_p(logits, md.top_k, md.top_p, md.top_k_max)
        return self._race(logits, md.generators, md.seeded)

    def _race(self, logits: torch.Tensor, generators: dict[int, torch.Generator],
              seeded: SeededDraws | None = None) -> torch.Tensor:
        probs = torch.softmax(logits, dim=-1)
        q = self._uniforms(probs, generators, seeded).log_().neg_()
        return (probs / q).argmax(dim=-1)

    def _uniforms(self, like: torch.Tensor, generators: dict[int, torch.Generator],
                  seeded: SeededDraws | None = None) -> torch.Tensor:
        """U[0, 1) float32 shaped like `like`; seeded rows draw theirs from their own generator, or
        on CUDA all at once by (seed, counter) (`seeded`). For the race, q = -log(u) ~ Exp(1):
        drawn from uniforms because on CPU torch.rand is ~8x faster than Tensor.exponential_ (1.6
        ms vs 13 ms for 16 x 49k draws). q is never 0 (u < 1), so a masked token (p = 0) scores
        0 / q = 0 and never NaN; u = 0 gives q = inf."""
        u = torch.empty(like.shape, dtype=torch.float32, device=like.device)
        if len(generators) < like.shape[0]:
            u.uniform_(generator=self.default_generator)
        if seeded is not None and like.is_cuda:
            from ferrox.kernels.seeded_uniforms import fill_seeded_uniforms

            fill_seeded_uniforms(u, seeded.rows, seeded.seeds, seeded.counters)
            return u
        for row, gen in generators.items():
            u[row].uniform_(generator=gen)
        return u

    def _sample_top_k_top_p_cuda(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """cuda/top_k_top_p_sampling.cu: both cuts by radix select, then an inverse-CDF draw -- no
        vocabulary sort and no host sync (the torch path syncs to size its top-k and to find rows
        whose nucleus is wide), so async scheduling keeps overlapping. Unseeded rows only (the
        caller redraws seeded ones), so every uniform comes from the default generator."""
        probs = torch.softmax(logits, dim=-1)
        batch = probs.shape[0]
        u = torch.empty(batch, dtype=torch.float32, device=probs.device).uniform_(generator=self.default_generator)
        top_k = md.top_k if md.top_k is not None else torch.zeros(batch, dtype=torch.int64, device=probs.device)
        top_p = md.top_p if md.top_p is not None else torch.ones(batch, dtype=torch.float32, device=probs.device)
        return cuda_sampling.top_k_top_p_sample(probs, top_k, top_p, u, ext=self.top_k_top_p_kernel)
