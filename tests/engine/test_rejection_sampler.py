"""The rejection sampler that verifies speculative drafts: greedy rows reproduce plain greedy
decoding, sampled rows keep the target distribution exactly (chi-square at a fixed seed, with a
check that the same test rejects two classic wrong implementations), seeded rows are reproducible
and independent of the batch."""

from __future__ import annotations

import pytest
import torch
from ferrox.layers import rejection_sampler as rs
from ferrox.layers.rejection_sampler import rejection_sample

V = 6
# Target distributions at the three verify positions of a 2-draft row, and a draft model's.
P = torch.tensor([[0.10, 0.05, 0.30, 0.25, 0.20, 0.10],
                  [0.05, 0.15, 0.10, 0.20, 0.40, 0.10],
                  [0.30, 0.10, 0.10, 0.10, 0.10, 0.30]])
Q = torch.tensor([[0.05, 0.05, 0.60, 0.10, 0.10, 0.10],
                  [0.30, 0.05, 0.05, 0.05, 0.25, 0.30]])
N = 30_000
CHI2_CRIT = 20.515  # chi-square, 5 degrees of freedom, p = 0.001


def chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=V).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def run_batch(drafts: torch.Tensor, draft_probs: torch.Tensor | None, seed: int = 0) -> rs.RejectionOutput:
    """N identical rows with 2 drafts each (drafts: [N, 2])."""
    g = torch.Generator().manual_seed(seed)
    return rejection_sample(P.repeat(N, 1), drafts.reshape(-1), [2] * N,
                            draft_probs=None if draft_probs is None else draft_probs.repeat(N, 1), default_generator=g)


def stats(out: rs.RejectionOutput) -> tuple[float, float, float]:
    """Chi-square of the first token against p_0, of the second (where the first draft was accepted)
    against p_1, of the third (both accepted: the bonus) against p_2."""
    toks, n = out.token_ids, out.num_sampled
    return chi2(toks[:, 0], P[0]), chi2(toks[n >= 2, 1], P[1]), chi2(toks[n == 3, 2], P[2])


def ngram_drafts() -> torch.Tensor:
    return torch.tensor([2, 4]).repeat(N, 1)


def model_drafts(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(Q[j], N, replacement=True, generator=g) for j in range(2)], dim=1)


def test_greedy_rows_accept_the_matching_prefix_then_the_targets_token():
    # Row 0: 3 drafts, argmaxes [1, 2, 0, 5]: drafts [1, 2, 3] -> accept 2, then 0.
    # Row 1: no drafts -> the argmax (4).  Row 2: 2 drafts all matching -> both + bonus 3.
    argmax = [1, 2, 0, 5, 4, 5, 1, 3]
    logits = torch.full((8, V), -1.0)
    logits[torch.arange(8), torch.tensor(argmax)] = 3.0
    out = rejection_sample(logits, torch.tensor([1, 2, 3, 5, 1]), [3, 0, 2], greedy=torch.tensor([True] * 3))
    assert out.num_sampled.tolist() == [3, 1, 3]
    assert out.token_ids.tolist() == [[1, 2, 0, -1], [4, -1, -1, -1], [5, 1, 3, -1]]
    assert out.flat().tolist() == [1, 2, 0, 4, 5, 1, 3]
    # A first-draft mismatch keeps nothing but the target's token.
    out = rejection_sample(logits[:4], torch.tensor([0, 2, 0]), [3], greedy=torch.tensor([True]))
    assert out.token_ids.tolist() == [[1, -1, -1, -1]] and out.num_sampled.tolist() == [1]


def test_mixed_batch_greedy_rows_ignore_randomness_and_sampled_rows_use_the_residual():
    # A sampled row whose target puts all mass on the draft always accepts it; one with p(draft) = 0
    # never does and draws from p without it.
    p = torch.zeros(5, V)
    p[0, 3] = 1.0  # row 0 pos 0: draft 3 certain
    p[1, 1] = 1.0  # row 0 bonus
    p[2, [0, 4]] = 0.5  # row 1 pos 0: draft 2 impossible
    p[3] = 1.0 / V  # row 1 bonus (unused)
    p[4, 5] = 1.0  # row 2 (greedy, no drafts)
    out = rejection_sample(p, torch.tensor([3, 2]), [1, 1, 0], greedy=torch.tensor([False, False, True]),
                           default_generator=torch.Generator().manual_seed(3))
    assert out.token_ids[0].tolist() == [3, 1] and out.token_ids[2].tolist() == [5, -1]
    assert out.num_sampled.tolist() == [2, 1, 1] and out.token_ids[1, 0].item() in (0, 4)


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_sampled_rows_keep_the_target_distribution(kind):
    drafts, q = (ngram_drafts(), None) if kind == "ngram" else (model_drafts(), Q)
    out = run_batch(drafts, q)
    first, second, third = stats(out)
    assert first < CHI2_CRIT and second < CHI2_CRIT and third < CHI2_CRIT, (first, second, third)
    # Accepted drafts are the drafts themselves, and some rows take each path.
    n = out.num_sampled
    assert (out.token_ids[n >= 2, 0] == drafts[n >= 2, 0]).all()
    assert (n == 1).any() and (n == 2).any() and (n == 3).any()


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
@pytest.mark.parametrize("wrong", ["no_residual", "always_accept"])
def test_the_distribution_test_rejects_wrong_samplers(monkeypatch, kind, wrong):
    """The chi-square above has the power to catch the classic mistakes: drawing the replacement from
    p instead of the residual, and accepting every draft."""
    if wrong == "no_residual":
        monkeypatch.setattr(rs, "_residual", lambda p, q: p)
    else:
        monkeypatch.setattr(rs, "_accept", lambda u, p, q: torch.ones_like(u, dtype=torch.bool))
    drafts, q = (ngram_drafts(), None) if kind == "ngram" else (model_drafts(), Q)
    first, _, _ = stats(run_batch(drafts, q))
    assert first > CHI2_CRIT, first


def test_seeded_rows_are_reproducible_and_independent_of_the_batch():
    p = P.repeat(3, 1)  # three requests with 2 drafts each
    drafts = torch.tensor([2, 4, 2, 4, 2, 4])

    def draw(seed_rows: dict[int, int], default_seed: int, probs=p, d=drafts, counts=(2, 2, 2)):
        gens = {r: torch.Generator().manual_seed(s) for r, s in seed_rows.items()}
        return rejection_sample(probs, d, list(counts), generators=gens,
                                default_generator=torch.Generator().manual_seed(default_seed))

    a = [draw({1: 7}, default_seed=s).token_ids[1].tolist() for s in range(20)]
    assert len({tuple(x) for x in a}) == 1, "seeded row 1 ignores the default generator"
    alone = draw({0: 7}, 0, probs=P, d=drafts[:2], counts=(2,)).token_ids[0].tolist()
    assert a[0] == alone, "and the rest of the batch"
    outs = {tuple(draw({1: s}, 0).token_ids[1].tolist()) for s in range(40)}
    assert len(outs) > 1, "different seeds, different draws"
