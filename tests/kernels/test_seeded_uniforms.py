"""Seeded rows' uniforms in one launch (kernels/seeded_uniforms.py): a function of (seed, counter)
alone, whatever the row or the batch; in [0, 1) and uniform; other rows untouched."""

from __future__ import annotations

import torch
from ferrox.kernels.seeded_uniforms import fill_seeded_uniforms
from ferrox.layers.sampler import seed_bits


def _draw(device, batch, rows, seeds, counters, vocab=5000):
    u = torch.full((batch, vocab), -1.0, device=device)
    as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    fill_seeded_uniforms(u, as_t(rows), as_t([seed_bits(s) for s in seeds]), as_t(counters))
    return u


def test_a_function_of_seed_and_counter(kernel_device):
    u = _draw(kernel_device, 4, [0, 2, 3], [7, 7, 2**64 - 1], [0, 1, 0])
    assert (u[1] == -1).all()  # an unseeded row is left alone
    drawn = u[[0, 2, 3]]
    assert (drawn >= 0).all() and (drawn < 1).all()
    assert abs(drawn.mean().item() - 0.5) < 0.02 and abs(drawn.std().item() - (1 / 12) ** 0.5) < 0.02
    assert not torch.equal(u[0], u[2])  # the next step of the same request draws anew
    assert not torch.equal(u[0], u[3])
    # The same request's draw, as another row of another batch: the same values.
    again = _draw(kernel_device, 2, [1], [7], [1])
    assert torch.equal(again[1], u[2])
    assert torch.equal(_draw(kernel_device, 1, [0], [-1], [0])[0], u[3])  # seeds wrap as manual_seed's do
