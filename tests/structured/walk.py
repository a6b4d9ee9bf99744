"""Drive a StructuredOutputManager without a model: each step, pick a random token among
those the grammar allows (the mask is the only thing deciding), like sampling at a very high
temperature. This exercises fill_bitmask / apply_bitmask / accept_tokens end to end."""

from __future__ import annotations

import numpy as np
import torch
from ferrox.structured.manager import StructuredOutputManager


def random_walk(
    manager: StructuredOutputManager,
    req_ids: list[str],
    eos_token_id: int,
    *,
    seed: int = 0,
    max_steps: int = 200,
) -> dict[str, tuple[list[int], bool]]:
    """Returns id -> (tokens without EOS, finished). Requests not known to the manager get
    unconstrained (all-ones) rows and are simply run along."""
    rng = np.random.default_rng(seed)
    tokens: dict[str, list[int]] = {r: [] for r in req_ids}
    finished: dict[str, bool] = {r: False for r in req_ids}
    for _ in range(max_steps):
        live = [r for r in req_ids if not finished[r]]
        if not live:
            break
        bitmask = manager.fill_bitmask(live)
        logits = torch.zeros(len(live), manager.vocab_size)
        if bitmask is not None:
            manager.apply_bitmask(logits, bitmask)
        sampled = np.array(
            [rng.choice(torch.nonzero(row > float("-inf")).flatten().numpy()) for row in logits],
            dtype=np.int64,
        )
        force_stop = manager.accept_tokens(live, sampled)
        for r, tok, stop in zip(live, sampled.tolist(), force_stop.tolist(), strict=True):
            if tok == eos_token_id:
                finished[r] = True
                continue
            tokens[r].append(tok)
            finished[r] = finished[r] or stop
    return {r: (tokens[r], finished[r]) for r in req_ids}
