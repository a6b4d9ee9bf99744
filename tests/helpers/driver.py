"""A minimal test driver for models: paged KV cache, trivial block assignment, batched prefill then
batched decode steps. Test code only -- the real engine (scheduler in Rust, model runner) is
elsewhere; this drives the model exactly through the interface the runner uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ferrox.attention.kv_cache import allocate_kv_caches
from ferrox.attention.metadata import AttentionMetadata


@dataclass
class StepRequest:
    token_ids: list[int]  # tokens computed this step
    start_pos: int  # position of token_ids[0] == tokens already in the cache
    block_ids: list[int]  # the request's blocks (enough for start_pos + len(token_ids))
    state_row: int = 0  # a hybrid model's recurrent-state row (worker/recurrent_states.py; 0: scratch)


def build_step(reqs: list[StepRequest], block_size: int, device: torch.device | str = "cpu"):
    """(input_ids, positions, AttentionMetadata) for one step over `reqs`, in the layout the
    scheduler produces (requests concatenated, slot = block * block_size + offset)."""
    ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
    max_blocks = max(len(r.block_ids) for r in reqs)
    table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    for i, r in enumerate(reqs):
        for j, tok in enumerate(r.token_ids):
            p = r.start_pos + j
            ids.append(tok)
            pos.append(p)
            slots.append(r.block_ids[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + len(r.token_ids))
        seq_lens.append(r.start_pos + len(r.token_ids))
        table[i, :len(r.block_ids)] = torch.tensor(r.block_ids, dtype=torch.int32)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    query_lens = [len(r.token_ids) for r in reqs]
    meta = AttentionMetadata(
        num_actual_tokens=len(ids),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=qsl_t.to(device),
        seq_lens=seq_t.to(device),
        block_table=table.to(device),
        query_start_loc_cpu=qsl_t,
        seq_lens_cpu=seq_t,
        decode_only=all(q == 1 for q in query_lens),
        state_rows=torch.tensor([r.state_row for r in reqs], dtype=torch.int32, device=device),
    )
    return (torch.tensor(ids, dtype=torch.int64, device=device), torch.tensor(pos, dtype=torch.int64, device=device),
            meta)


def bind_recurrent_states(model, num_requests: int) -> None:
    """A hybrid model's state pools for num_requests requests (rows 1..n; row 0 scratch), in the model's dtype
    (worker/recurrent_states.py); nothing for other models."""
    from ferrox.worker.recurrent_states import allocate_recurrent_states, recurrent_layers

    if recurrent_layers(model):
        param = next(model.parameters())
        allocate_recurrent_states(model, num_requests, 0, param.dtype, param.dtype, param.device)


def last_token_rows(meta: AttentionMetadata) -> torch.Tensor:
    return (meta.query_start_loc_cpu[1:] - 1).to(torch.int64)


@torch.inference_mode()
def run_greedy(model, prompts_ids: list[list[int]], max_new_tokens: int, *, block_size: int = 16,
               prefill_chunk: int | None = None, return_prefill_logits: bool = False):
    """Greedy continuation of every prompt, all in one batch. Returns the new token ids per prompt
    (and, if asked, the float32 logits at each prompt's last token from the prefill).

    prefill_chunk: split prompts into chunks of this many tokens (exercises cached-context prefill).
    """
    spec = model.spec
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    blocks_per_seq = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts_ids]
    caches = allocate_kv_caches(spec, 1 + sum(blocks_per_seq), block_size, dtype, device)
    bind_recurrent_states(model, len(prompts_ids))
    tables, nxt = [], 1  # block 0 is the null block
    for n in blocks_per_seq:
        tables.append(list(range(nxt, nxt + n)))
        nxt += n

    # Prefill (optionally chunked: every request advances by up to `prefill_chunk` tokens a step).
    done = [0] * len(prompts_ids)
    last_logits = [None] * len(prompts_ids)
    while any(d < len(p) for d, p in zip(done, prompts_ids, strict=True)):
        reqs, owners = [], []
        for i, p in enumerate(prompts_ids):
            if done[i] < len(p):
                end = len(p) if prefill_chunk is None else min(len(p), done[i] + prefill_chunk)
                reqs.append(StepRequest(p[done[i]:end], done[i], tables[i], i + 1))
                owners.append(i)
        ids, pos, meta = build_step(reqs, block_size, device)
        hidden = model(ids, pos, caches, meta)
        logits = model.compute_logits(hidden[last_token_rows(meta).to(device)])
        for row, i in enumerate(owners):
            done[i] += len(reqs[row].token_ids)
            last_logits[i] = logits[row]

    out = [[int(lg.argmax())] for lg in last_logits]
    for _ in range(max_new_tokens - 1):
        reqs = [StepRequest([o[-1]], len(p) + len(o) - 1, t, i + 1)
                for i, (p, o, t) in enumerate(zip(prompts_ids, out, tables, strict=True))]
        ids, pos, meta = build_step(reqs, block_size, device)
        hidden = model(ids, pos, caches, meta)
        nxt_tokens = model.compute_logits(hidden).argmax(-1).tolist()
        for o, t in zip(out, nxt_tokens, strict=True):
            o.append(int(t))
    if return_prefill_logits:
        return out, torch.stack(last_logits)
    return out


@torch.inference_mode()
def teacher_forced_logprobs(model, prompt: list[int], continuation: list[int], *, decode_steps: bool,
                            block_size: int = 16) -> torch.Tensor:
    """float32 log-probabilities [len(continuation), vocab] of each continuation token's position,
    the model fed the continuation whatever it would have picked. decode_steps False: one prefill of
    prompt + continuation; True: the prompt's prefill, then one decode step per token (the path a
    served request takes, e.g. a decode kernel of its own)."""
    seq = prompt + continuation
    blocks = list(range(1, 2 + len(seq) // block_size))
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    caches = allocate_kv_caches(model.spec, 2 + len(blocks), block_size, dtype, device)
    bind_recurrent_states(model, 1)
    if not decode_steps:
        ids, pos, meta = build_step([StepRequest(seq, 0, blocks, 1)], block_size, device)
        rows = torch.arange(len(prompt) - 1, len(seq) - 1)
        return torch.log_softmax(model.compute_logits(model(ids, pos, caches, meta)[rows]).float(), dim=-1)
    ids, pos, meta = build_step([StepRequest(prompt, 0, blocks, 1)], block_size, device)
    logits = [model.compute_logits(model(ids, pos, caches, meta)[-1:])]
    for k, token in enumerate(continuation[:-1]):
        ids, pos, meta = build_step([StepRequest([token], len(prompt) + k, blocks, 1)], block_size, device)
        logits.append(model.compute_logits(model(ids, pos, caches, meta)))
    return torch.log_softmax(torch.cat(logits).float(), dim=-1)
