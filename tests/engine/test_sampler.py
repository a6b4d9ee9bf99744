"""The sampler on crafted logits: truncation never leaks, the distribution matches softmax,
seeded draws do not depend on the batch, logprobs equal log_softmax, penalties/bias/masks act."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ferrox.layers.sampler import PenaltyInputs, Sampler, SamplingMetadata, compute_logprobs
from ferrox.sampling_params import SamplingParams
from ferrox.worker.input_batch import InFlight, InputBatch

VOCAB = 8
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


class _Batch:
    """An InputBatch holding `params` in slots 0..n-1 (prompt [1, 2, 3] each), built per step as
    the model runner builds it."""

    def __init__(self, params: list[SamplingParams], eos: list[int] | None = None, vocab: int = VOCAB) -> None:
        self.batch = InputBatch(vocab, list(eos or []), torch.device("cpu"), capacity=4)
        for i, p in enumerate(params):
            self.batch.add(i, f"r{i}", [1, 2, 3], p)
        self.slots = np.arange(len(params), dtype=np.int32)

    def build(self, in_flight: InFlight | None = None) -> SamplingMetadata:
        n = len(self.slots)
        return self.batch.sampling_metadata(self.slots, torch.from_numpy(self.slots.astype(np.int64)),
                                            np.ones(n, dtype=np.bool_), in_flight)

    def accept(self, slot: int, token: int) -> None:
        self.batch.append_accepted(np.array([slot], dtype=np.int32), np.array([token], dtype=np.int32),
                                   np.array([0, 1], dtype=np.int32))


def _draw(params: SamplingParams, rows: int, logits: torch.Tensor = LOGITS, seed: int = 0) -> torch.Tensor:
    """`rows` independent draws for one request's settings (one batch of identical rows)."""
    md = _Batch([params] * rows, vocab=logits.shape[-1]).build()
    sampler = Sampler(torch.Generator().manual_seed(seed))
    return sampler(logits.repeat(rows, 1), md).token_ids


def test_greedy_is_argmax_and_mixed_batch():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)]
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    md = _Batch(params).build()
    assert not md.all_greedy and md.greedy_rows is not None
    out = Sampler(torch.Generator().manual_seed(0))(logits.clone(), md)
    assert out.token_ids[0].item() == 0


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.5), {0, 1}),  # p(0)=0.38, p(0)+p(1)=0.61 >= 0.5
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # p/pmax: 1, .61, .37, .22 ...
        (SamplingParams(top_p=0.7), {0, 1, 2}),
        (SamplingParams(top_k=4, top_p=0.7), {0, 1}),  # top-p over the top-k renormalized: .46, .73
    ],
)
def test_truncation_never_emits_excluded_tokens(params, allowed):
    tokens = _draw(params, 4000)
    assert set(tokens.tolist()) == allowed  # every allowed token shows up, nothing else


def test_distribution_matches_softmax():
    n = 20000
    tokens = _draw(SamplingParams(temperature=1.0), n)
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    expected = torch.softmax(LOGITS.double(), dim=0) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001
    assert chi2 < 24.3, (counts, expected)


def test_temperature_sharpens():
    cold = torch.bincount(_draw(SamplingParams(temperature=0.25), 4000), minlength=VOCAB)
    hot = torch.bincount(_draw(SamplingParams(temperature=1.0), 4000), minlength=VOCAB)
    assert cold[0] > hot[0] + 500


def test_seeded_rows_do_not_depend_on_batch():
    vocab = 1000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_size: int, position: int, steps: int = 20) -> list[int]:
        params = [SamplingParams(temperature=1.0) for _ in range(batch_size)]
        params[position] = p
        batch = _Batch(params, vocab=vocab)
        sampler = Sampler(torch.Generator().manual_seed(batch_size))
        out = []
        for _ in range(steps):
            md = batch.build()
            out.append(int(sampler(logits.repeat(batch_size, 1), md).token_ids[position]))
        return out

    alone = run(1, 0)
    assert run(5, 3) == alone and run(3, 0) == alone
    assert len(set(alone)) > 1  # it really samples


def test_logprobs_equal_log_softmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    chosen = torch.tensor([4, 7, 9])
    lp = compute_logprobs(logits, chosen, 5)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert torch.allclose(lp.token_logprobs.double(), ref.gather(1, chosen[:, None]).squeeze(1), atol=1e-5)
    top = torch.topk(ref, 5, dim=-1)
    assert torch.equal(lp.top_token_ids, top.indices)
    assert torch.allclose(lp.top_logprobs.double(), top.values, atol=1e-5)
    expected_rank = (ref > ref.gather(1, chosen[:, None])).sum(-1) + 1
    assert torch.equal(lp.token_ranks, expected_rank)


def test_sampler_logprobs_are_raw_not_processed():
    params = SamplingParams(temperature=0, logprobs=2, logit_bias={7: 50.0})
    md = _Batch([params]).build()
    out = Sampler()(LOGITS[None].clone(), md)
    assert out.token_ids.item() == 7  # the bias decides the token ...
    raw = torch.log_softmax(LOGITS, dim=-1)
    assert out.logprobs is not None  # ... but logprobs are the model's own
    assert math.isclose(out.logprobs.token_logprobs.item(), raw[7].item(), abs_tol=1e-5)
    assert out.logprobs.token_ranks.item() == VOCAB
    assert out.logprobs.top_token_ids[0].tolist() == [0, 1]


def test_named_logprob_token_ids_replace_the_top_n_on_their_rows_only():
    # Row 0 takes the top 3, row 1 names [6, 2, 7] (vLLM's logprob_token_ids, order kept), row 2 names one
    # id and also sets logprobs (the named ids win), row 3 asks for nothing; a penalty-free greedy batch.
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0, logprob_token_ids=[6, 2, 7]),
              SamplingParams(temperature=0, logprobs=5, logprob_token_ids=[4]), SamplingParams(temperature=0)]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    md = _Batch(params).build()
    assert md.max_num_logprobs == 3 and md.logprob_token_ids is not None
    out = Sampler()(logits.clone(), md)
    assert out.logprobs is not None
    ref = torch.log_softmax(logits.double(), dim=-1)
    ids, lps = out.logprobs.top_token_ids, out.logprobs.top_logprobs.double()
    assert ids.shape[1] == 3
    assert torch.equal(ids[0], torch.topk(ref[0], 3).indices)
    assert ids[1].tolist() == [6, 2, 7] and ids[2, 0].item() == 4
    for row in range(3):
        assert torch.allclose(lps[row], ref[row, ids[row]], atol=1e-5)
    # The sampled token's own logprob and rank on every row, named or not.
    expected_rank = (ref > ref.gather(1, out.token_ids[:, None])).sum(-1) + 1
    assert torch.equal(out.logprobs.token_ranks, expected_rank)
    # Per-row counts the host trims to: the named rows report exactly their ids.
    assert _Batch(params).batch.num_logprobs[:4].tolist() == [3, 3, 1, -1]


def test_named_logprob_token_ids_wider_than_the_top_n_and_alone():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(2))
    named = torch.tensor([[-1, -1, -1, -1], [49, 0, 17, 49]])
    lp = compute_logprobs(logits, torch.tensor([3, 4]), 2, named)
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert lp.top_token_ids.shape == (2, 4)
    assert torch.equal(lp.top_token_ids[0, :2], torch.topk(ref[0], 2).indices)
    assert lp.top_token_ids[1].tolist() == [49, 0, 17, 49]
    assert torch.allclose(lp.top_logprobs[1].double(), ref[1, [49, 0, 17, 49]], atol=1e-5)
    only_named = compute_logprobs(logits[1:], torch.tensor([4]), 0, named[1:, :3])
    assert only_named.top_token_ids[0].tolist() == [49, 0, 17]


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes(mode):
    """vLLM's --logprobs-mode on one greedy row with a logit bias and one random row (temperature 0.5,
    top-k 3): raw_* read the model's logits, processed_* the ones the draw saw (bias; then temperature
    and top-k on the random row, the dropped tokens -inf); *_logits report them without log-softmax."""
    params = [SamplingParams(temperature=0, logprobs=2, logit_bias={7: 50.0}),
              SamplingParams(temperature=0.5, top_k=3, logprobs=2, seed=1)]
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    out = Sampler(torch.Generator().manual_seed(0), logprobs_mode=mode)(logits.clone(), _Batch(params).build())
    seen = logits.clone()
    if mode.startswith("processed"):
        seen[0, 7] += 50.0
        seen[1] = seen[1] / 0.5
        seen[1, torch.argsort(seen[1], descending=True)[3:]] = float("-inf")
    expect = torch.log_softmax(seen, dim=-1) if mode.endswith("logprobs") else seen
    assert out.logprobs is not None
    got = out.logprobs.token_logprobs
    assert torch.allclose(got, expect.gather(1, out.token_ids[:, None]).squeeze(1), atol=1e-5), (got, expect)
    assert torch.allclose(out.logprobs.top_logprobs, torch.topk(expect, 2).values, atol=1e-5)
    assert out.token_ids[0].item() == 7 and out.token_ids[1].item() in set(torch.topk(LOGITS.flip(0), 3).indices.tolist())


def test_unknown_logprobs_mode_is_refused():
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler(logprobs_mode="raw")


def test_logit_bias_and_allowed_token_ids():
    assert set(_draw(SamplingParams(allowed_token_ids=[5, 6]), 500).tolist()) == {5, 6}
    assert set(_draw(SamplingParams(temperature=0, allowed_token_ids=[3, 6]), 4).tolist()) == {3}
    assert set(_draw(SamplingParams(logit_bias={0: -100.0, 1: -100.0}), 2000).tolist()) <= set(range(2, VOCAB))


def test_penalties():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    sampler_rows = torch.tensor([0])
    p = PenaltyInputs(
        rows=sampler_rows,
        prompt_mask=torch.tensor([[False, False, True, False]]),
        output_counts=torch.tensor([[2.0, 0.0, 0.0, 1.0]]),
        repetition=torch.tensor([2.0]),
        frequency=torch.tensor([0.5]),
        presence=torch.tensor([0.25]),
    )
    md = SamplingMetadata(all_greedy=True, penalties=p)
    Sampler.apply_logits_processors(logits, md)
    # token 0: seen in output (2x): 2/2 - 0.5*2 - 0.25 ; token 2: prompt only: -1*2 ; token 3: 0.5/2 - 0.5 - 0.25
    expected = torch.tensor([[2 / 2 - 1.0 - 0.25, 1.0, -2.0, 0.25 - 0.5 - 0.25]])
    assert torch.allclose(logits, expected)


def test_penalty_state_tracks_outputs():
    params = SamplingParams(temperature=0, frequency_penalty=2.0)
    batch = _Batch([params])
    sampler = Sampler()
    seen = []
    for _ in range(VOCAB):
        tok = int(sampler(LOGITS[None].clone(), batch.build()).token_ids[0])
        batch.accept(0, tok)
        seen.append(tok)
    # A strong frequency penalty walks greedy decoding down the ranking instead of repeating.
    assert len(set(seen[:4])) == 4


def test_in_flight_token_counts_before_it_reaches_the_host():
    """Async scheduling: the previous step's token, still on the device, already counts for the
    penalties and for min_tokens; once the core accepts it, it counts exactly once."""
    params = SamplingParams(temperature=0, frequency_penalty=2.0, min_tokens=2, stop_token_ids=[1])
    batch = _Batch([params], eos=[0])
    slots = np.zeros(1, dtype=np.int32)
    in_flight = InFlight(slots, batch.batch.generation[slots].copy(), np.ones(1, dtype=np.bool_),
                         torch.tensor([0]))  # token 0 sampled, not yet accepted
    md = batch.build(in_flight)
    assert md.penalties is not None and md.penalties.output_counts[0, 0].item() == 1.0
    assert md.banned is not None  # 1 of 2 min_tokens produced: stops still banned
    batch.accept(0, 0)
    assert batch.build().penalties.output_counts[0, 0].item() == 1.0  # counted once
    md = batch.build(InFlight(slots, batch.batch.generation[slots].copy(), np.ones(1, dtype=np.bool_),
                              torch.tensor([3])))
    assert md.banned is None and md.penalties.output_counts[0, 3].item() == 1.0
    # A slot given to a new request since: the old in-flight token is not its own.
    stale = InFlight(slots, batch.batch.generation[slots].copy(), np.ones(1, dtype=np.bool_), torch.tensor([5]))
    batch.batch.remove([0])
    batch.batch.add(0, "new", [1], params)
    md = batch.build(stale)
    assert md.penalties.output_counts[0].sum().item() == 0.0 and md.banned is not None


def _banned(md: SamplingMetadata, logits_row: torch.Tensor = LOGITS) -> set[int]:
    """The tokens the metadata's logits processors set to -inf on row 0."""
    logits = logits_row[None].clone()
    Sampler.apply_logits_processors(logits, md)
    return {int(t) for t in torch.nonzero(torch.isinf(logits[0])).flatten()}


def test_bad_words_ban_one_token_words_always_and_a_longer_word_after_its_prefix():
    """vLLM's bad_words on their token sequences: [5] is never sampled; [2, 3, 7] bans 7 only right after
    an output ending in 2, 3 (the output's tokens, not the prompt's: the prompt is [1, 2, 3])."""
    params = SamplingParams(temperature=0, bad_words_token_ids=[[5], [2, 3, 7]])
    batch = _Batch([params])
    assert _banned(batch.build()) == {5}  # the prompt ends in 2, 3: not the output
    batch.accept(0, 2)
    assert _banned(batch.build()) == {5}
    batch.accept(0, 3)
    assert _banned(batch.build()) == {5, 7}
    batch.accept(0, 4)
    assert _banned(batch.build()) == {5}
    # The greedy pick moves off a banned token: 7 is the argmax here.
    logits = LOGITS.clone()
    logits[7] = 10.0
    batch.accept(0, 2)
    batch.accept(0, 3)
    assert Sampler()(logits[None].clone(), batch.build()).token_ids.item() == 0


def test_bad_word_ban_hangs_on_the_in_flight_token():
    """Async scheduling: the output's last token may still be on the device; the ban of 7 after [2, 3]
    then depends on it, decided on the device without a sync."""
    params = SamplingParams(temperature=0, bad_words_token_ids=[[2, 3, 7], [4, 6]])
    batch = _Batch([params])
    slots = np.zeros(1, dtype=np.int32)

    def flight(token: int) -> InFlight:
        return InFlight(slots, batch.batch.generation[slots].copy(), np.ones(1, dtype=np.bool_), torch.tensor([token]))

    assert _banned(batch.build(flight(4))) == {6}  # [4, 6]: its prefix is the in-flight token alone
    assert _banned(batch.build(flight(2))) == set()  # [2, 3, 7] needs two output tokens
    batch.accept(0, 2)
    assert _banned(batch.build(flight(3))) == {7}
    assert _banned(batch.build(flight(5))) == set()
    md = batch.build(flight(3))
    assert md.banned_if is not None and md.banned is None


def test_penalty_rows_grow_and_are_reused_clean():
    """Penalty requests share one [rows, V] tensor pair (worker/penalty_rows.py): more requests than
    its first 8 rows grow it without losing counts, a leaving request's row comes back zeroed
    with the next request's prompt mask, and a step's tokens for every row count in one add."""
    params = SamplingParams(temperature=0, frequency_penalty=1.0, repetition_penalty=1.5)
    batch = _Batch([params] * 10)
    n = len(batch.slots)
    batch.batch.append_accepted(batch.slots, np.arange(n, dtype=np.int32) % VOCAB,
                                np.arange(n + 1, dtype=np.int32))
    batch.batch.append_accepted(batch.slots[:1], np.array([3, 3], dtype=np.int32), np.array([0, 2], dtype=np.int32))
    md = batch.build()
    assert md.penalties is not None and md.penalties.output_counts.shape == (n, VOCAB)
    expected = torch.zeros(n, VOCAB)
    expected[torch.arange(n), torch.arange(n) % VOCAB] = 1.0
    expected[0, 3] += 2.0
    assert torch.equal(md.penalties.output_counts, expected)
    assert md.penalties.prompt_mask[:, 1:4].all() and not md.penalties.prompt_mask[:, 4:].any()
    batch.batch.remove([9])
    batch.batch.add(9, "again", [5], params)
    md = batch.build()
    assert md.penalties.output_counts[9].sum().item() == 0.0
    assert md.penalties.prompt_mask[9].nonzero().flatten().tolist() == [5]
    assert batch.batch.penalties.counts.shape[0] == 16  # grown once, the freed row reused


def test_min_tokens_bans_stop_ids():
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    batch = _Batch([params], eos=[0])
    sampler = Sampler()
    toks = []
    for _ in range(3):
        tok = int(sampler(LOGITS[None].clone(), batch.build()).token_ids[0])
        batch.accept(0, tok)
        toks.append(tok)
    assert toks == [2, 2, 0]  # EOS (0) and stop id (1) are hidden until two tokens are out


def test_masked_tokens_are_never_drawn():
    """Heavily masked rows (grammar / allowed_token_ids): no draw may land on a -inf logit."""
    vocab = 4096
    logits = torch.full((64, vocab), float("-inf"))
    logits[:, 7] = 0.0
    logits[:, 9] = 0.5
    params = [SamplingParams(temperature=1.0) for _ in range(64)]
    md = _Batch(params, vocab=vocab).build()
    sampler = Sampler(torch.Generator().manual_seed(0))
    for _ in range(200):
        assert set(sampler(logits.clone(), md).token_ids.tolist()) <= {7, 9}


def test_top_p_candidate_path_equals_full_sort():
    from ferrox.layers import logits_processors as lp

    gen = torch.Generator().manual_seed(0)
    for scale in (0.3, 3.0, 10.0):  # flat rows take the full-sort fallback, peaked rows the top-256 path
        logits = torch.randn(8, 5000, generator=gen) * scale
        top_p = torch.rand(8, generator=gen) * 0.98 + 0.01
        top_p[0] = 1.0
        fast = lp.apply_top_k_top_p(logits, None, top_p)
        exact = lp._top_p_by_sort(logits, top_p)
        assert torch.equal(torch.isinf(fast), torch.isinf(exact))
        assert not torch.isinf(fast[0]).any()


def test_top_k_bound_from_the_host_leaves_rows_without_top_k_alone():
    """The top-k cut takes its largest k from the host (SamplingMetadata.top_k_max, no device sync);
    a row without top-k (k = vocab) in the same batch keeps every token."""
    from ferrox.layers import logits_processors as lp

    md = _Batch([SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0),
                 SamplingParams(temperature=1.0, top_k=3)]).build()
    assert md.top_k_max == 3 and md.top_k is not None
    cut = lp.apply_top_k_top_p(LOGITS.repeat(3, 1), md.top_k, None, md.top_k_max)
    assert torch.isfinite(cut).sum(dim=1).tolist() == [2, VOCAB, 3]
    assert torch.equal(cut, lp.apply_top_k_top_p(LOGITS.repeat(3, 1), md.top_k, None))  # bound from the device


def test_reused_slot_gets_its_new_parameters():
    batch = _Batch([SamplingParams(temperature=0)])
    assert batch.build().all_greedy
    batch.batch.remove([0])
    batch.batch.add(0, "same-id", [1], SamplingParams(temperature=1.0, top_k=2))
    md = batch.build()
    assert not md.all_greedy and md.top_k is not None and md.top_k.tolist() == [2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_request_joins_without_waiting_for_the_device():
    """A request joins while a step is in flight (async scheduling): writing its sampling row must
    not synchronize with the stream (a single-element assignment to a CUDA tensor does)."""
    batch = InputBatch(VOCAB, [7], torch.device("cuda"), capacity=4)
    params = [SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05, seed=1),
              SamplingParams(temperature=0), SamplingParams(temperature=1.0, repetition_penalty=1.2,
                                                            allowed_token_ids=[1, 2, 3])]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for slot, p in enumerate(params):
            batch.add(slot, f"r{slot}", [1, 2, 3], p)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert batch.temperature[:3].tolist() == pytest.approx([0.7, 1.0, 1.0])
    assert batch.top_k[:3].tolist() == [3, VOCAB, VOCAB]
    assert batch.greedy_dev[:3].tolist() == [False, True, False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_every_kind_never_waits_for_the_device():
    """Under async scheduling the sampler is queued while a step is in flight (and, with a grammar row,
    behind a mask gate): no row kind may make it wait for the stream. Top-k and top-p rows on the torch
    path (no CUDA kernel), a seeded one, min_tokens bans, penalties, logprobs, greedy, in one batch."""
    from ferrox.worker.step_inputs import Uploader

    vocab = 5000
    dev = torch.device("cuda")
    batch = InputBatch(vocab, [7], dev, capacity=8, upload=Uploader(dev))  # pinned uploads, as the runner's
    params = [SamplingParams(temperature=0.7, top_k=40, top_p=0.9), SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, top_p=0.5, seed=3), SamplingParams(temperature=0.9, top_k=5, seed=4),
              SamplingParams(temperature=1.0, min_tokens=4), SamplingParams(temperature=1.0, repetition_penalty=1.3,
                                                                              frequency_penalty=0.2),
              SamplingParams(temperature=0.8, logprobs=3)]
    for slot, p in enumerate(params):
        batch.add(slot, f"r{slot}", [1, 2, 3], p)
    slots = np.arange(len(params), dtype=np.int32)
    slots_dev = torch.from_numpy(slots.astype(np.int64)).cuda()
    logits = torch.randn(len(params), vocab, device="cuda")
    sampler = Sampler(torch.Generator(device="cuda").manual_seed(0))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = batch.sampling_metadata(slots, slots_dev, np.ones(len(params), dtype=np.bool_), None)
        out = sampler(logits.clone(), md)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tokens = out.token_ids.tolist()
    assert tokens[1] == int(logits[1].argmax())
    assert tokens[4] != 7  # min_tokens hides EOS
    assert int(logits[0].topk(40).indices.eq(tokens[0]).sum()) == 1
    assert int(logits[3].topk(5).indices.eq(tokens[3]).sum()) == 1
