"""The one-pass sampling draw (kernels/exponential_race.py) against the torch formula the CPU
sampler uses: the same token for the same uniforms, masked tokens never drawn, and draws
distributed as softmax(logits / T)."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.exponential_race import exponential_race


def _torch_race(logits, temperature, u):
    probs = torch.softmax(logits.double() / temperature.double()[:, None], dim=-1)
    return probs / -torch.log(u.double())


def _case(device, batch, vocab, dtype):
    logits = (torch.randn(batch, vocab, device=device) * 4).to(dtype)
    logits[0, : vocab // 2] = float("-inf")  # a masked half (grammar / top-k style)
    temperature = torch.rand(batch, device=device) + 0.3
    u = torch.rand(batch, vocab, device=device)
    u[1, 3] = 0.0  # q = inf: token 3 of row 1 cannot win
    got = exponential_race(logits, temperature, u)
    scores = _torch_race(logits.float(), temperature, u)
    want = scores.argmax(-1)
    assert got.dtype == torch.int64 and got.shape == (batch,)
    # Same winner, or (rounding) a runner-up whose score equals the winner's to ~1e-6.
    chosen = scores.gather(1, got[:, None]).squeeze(1)
    assert torch.all((got == want) | (chosen >= scores.max(-1).values * (1 - 1e-6)))
    assert int(got[0]) >= vocab // 2 and not (int(got[1]) == 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_race_matches_torch_formula(kernel_device, seed, dtype):
    _case(kernel_device, 4, 300, dtype)  # one partial tile
    _case(kernel_device, 3, 5000, dtype)  # several tiles and a ragged tail


def test_race_draws_follow_softmax(kernel_device, seed):
    vocab, draws = 6, 2000
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf"), 0.5], device=kernel_device)
    temperature = torch.full((draws,), 0.7, device=kernel_device)
    tokens = exponential_race(logits.expand(draws, vocab).contiguous(), temperature,
                              torch.rand(draws, vocab, device=kernel_device))
    freq = torch.bincount(tokens.cpu(), minlength=vocab).double() / draws
    expected = torch.softmax(logits.cpu().double() / 0.7, dim=-1)
    assert freq[4] == 0
    assert (freq - expected).abs().max() < 0.05  # ~4.5 sigma at 2000 draws


def test_race_rejects_bad_shapes(kernel_device):
    with pytest.raises(ValueError, match="uniforms must both be"):
        exponential_race(torch.zeros(2, 5, device=kernel_device), torch.ones(2, device=kernel_device),
                         torch.zeros(2, 4, device=kernel_device))
    with pytest.raises(ValueError, match="temperature must be"):
        exponential_race(torch.zeros(2, 5, device=kernel_device), torch.ones(3, device=kernel_device),
                         torch.zeros(2, 5, device=kernel_device))


@pytest.mark.gpu
def test_race_llama_vocab(cuda_device, seed):
    _case(cuda_device, 512, 128256, torch.float32)
