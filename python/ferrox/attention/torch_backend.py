"""Reference attention backend in plain torch: runs on CPU (tests, the embedded model) and is the
oracle the GPU kernels are tested against.

Per step (in `begin_forward`) the metadata becomes a plan, shared by every layer:
  * decode requests (one query token) form one group: their KV is gathered through the block table
    into a padded [B, L] tensor and attended with one masked SDPA call;
  * each prefill chunk gets one SDPA call: over its own k/v with `is_causal` when it starts at
    position 0, else over its gathered cached KV with an offset causal mask.
Per layer the work is then: two index_copy_ into the cache, a gather per group, an SDPA per group.

An FP8 cache (attention/kv_cache.py) stores quantize_kv(k, k_scale) and quantize_kv(v, v_scale);
attention runs over the stored values widened to the model's dtype (exact: every E4M3 value is a
bf16/fp16/fp32 value) with k_scale folded into the softmax scale and v_scale applied to the
output. A prompt chunk attends over its own rows after the same round trip, so its output does not
depend on whether its prefix was computed now or read from the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ferrox.attention.backend import AttentionBackend
from ferrox.attention.kv_cache import quantize_kv
from ferrox.attention.kv_scale_calibration import calibrate_if_armed
from ferrox.attention.metadata import AttentionMetadata
from ferrox.kernels.kv_fp8 import is_fp8_kv_cache


@dataclass(slots=True)
class _DecodeGroup:
    token_slice: slice | None  # contiguous query rows (the usual case: decodes lead the batch) ...
    token_index: torch.Tensor | None  # ... or explicit row indices
    block_ids: torch.Tensor  # [B, blocks] int64, enough blocks for the longest sequence
    kv_len: int  # longest seq_len in the group: gathered KV is cut to this
    mask: torch.Tensor | None  # [B, 1, 1, kv_len] bool (True = attend), None if all lengths equal
    lens: list[int] = field(default_factory=list)  # each row's seq_len (a sliding window's masks)


@dataclass(slots=True)
class _PrefillChunk:
    start: int  # query rows start:end
    end: int
    context_len: int  # tokens already cached before this chunk (0 = a fresh prompt)
    seq_len: int
    block_ids: torch.Tensor | None  # [blocks] int64, only when context_len > 0
    mask: torch.Tensor | None  # [q_len, seq_len] bool offset-causal, only when context_len > 0 (or images)
    # [q_len, seq_len] bool: query and key in the same bidirectional range (an image), None without one.
    both_ways: torch.Tensor | None = None


@dataclass(slots=True)
class _Plan:
    num_tokens: int
    decode: _DecodeGroup | None = None
    prefills: list[_PrefillChunk] = field(default_factory=list)
    # (Sliding window, attention chunk) -> (each prefill chunk's mask, the decode group's mask), built at
    # the first layer with that pair (Gemma's local layers share theirs, Llama 4's chunked layers theirs).
    windowed: dict[tuple[int, int], tuple[list[torch.Tensor], torch.Tensor | None]] = field(default_factory=dict)

    def window_masks(self, window: int, device: torch.device,
                     chunk: int = 0) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Masks (True = attend) of causal attention within `window`: a query at position p sees keys
        p - window < k <= p (itself and the window - 1 before it, as transformers and vLLM count it);
        and within `chunk` (Llama 4's chunked local attention): keys of p's own chunk,
        (p // chunk) * chunk <= k <= p. 0: no such limit."""
        if (window, chunk) not in self.windowed:
            chunks = []
            for prefill in self.prefills:
                q_pos = torch.arange(prefill.context_len, prefill.seq_len, device=device)[:, None]
                kv = torch.arange(prefill.seq_len, device=device)[None, :]
                seen = kv <= q_pos if prefill.both_ways is None else (kv <= q_pos) | prefill.both_ways
                # (Gemma 3: an image's tokens see each other both ways, within the window.)
                if window:
                    seen = seen & (kv > q_pos - window)
                if chunk:
                    seen = seen & (kv >= q_pos // chunk * chunk)
                chunks.append(seen)
            decode = None
            if self.decode is not None:
                lens = torch.tensor(self.decode.lens, device=device)[:, None]
                kv = torch.arange(self.decode.kv_len, device=device)[None, :]
                seen = kv < lens
                if window:
                    seen = seen & (kv >= lens - window)
                if chunk:  # the query sits at lens - 1
                    seen = seen & (kv >= (lens - 1) // chunk * chunk)
                decode = seen[:, None, None, :]
            self.windowed[(window, chunk)] = (chunks, decode)
        return self.windowed[(window, chunk)]


def _build_plan(meta: AttentionMetadata, block_size: int, has_cache: bool) -> _Plan:
    starts = meta.query_start_loc_cpu.tolist()
    seq_lens = meta.seq_lens_cpu.tolist()
    plan = _Plan(num_tokens=meta.num_actual_tokens)
    decode_rows: list[int] = []
    device = meta.block_table.device
    for r, seq_len in enumerate(seq_lens):
        start, end = starts[r], starts[r + 1]
        q_len = end - start
        if q_len == 0:
            continue
        context = seq_len - q_len
        if context < 0:
            raise ValueError(f"request {r}: seq_len {seq_len} is shorter than its {q_len} query tokens")
        if not has_cache and context > 0:
            raise ValueError(f"request {r} has {context} cached tokens but the step has no KV cache")
        if q_len == 1 and has_cache:
            decode_rows.append(r)
            continue
        chunk = _PrefillChunk(start, end, context, seq_len, None, None)
        spans = meta.bidirectional.get(r) if meta.bidirectional else None
        if context > 0:
            n_blocks = -(-seq_len // block_size)
            chunk.block_ids = meta.block_table[r, :n_blocks].to(torch.int64)
        if context > 0 or spans:
            q_pos = torch.arange(context, seq_len, device=device)[:, None]
            kv = torch.arange(seq_len, device=device)[None, :]
            chunk.mask = kv <= q_pos
            if spans:
                chunk.both_ways = torch.zeros_like(chunk.mask)
                for lo, hi in spans:
                    chunk.both_ways |= (q_pos >= lo) & (q_pos < hi) & (kv >= lo) & (kv < hi)
                chunk.mask = chunk.mask | chunk.both_ways
        plan.prefills.append(chunk)
    if decode_rows:
        rows = torch.tensor(decode_rows, dtype=torch.int64)
        lens = [seq_lens[r] for r in decode_rows]
        kv_len = max(lens)
        n_blocks = -(-kv_len // block_size)
        token_rows = [starts[r] for r in decode_rows]
        contiguous = token_rows == list(range(token_rows[0], token_rows[0] + len(token_rows)))
        mask = None
        if min(lens) != kv_len:
            lens_t = torch.tensor(lens, device=device)
            mask = (torch.arange(kv_len, device=device)[None, :] < lens_t[:, None])[:, None, None, :]
        plan.decode = _DecodeGroup(
            token_slice=slice(token_rows[0], token_rows[0] + len(token_rows)) if contiguous else None,
            token_index=None if contiguous else torch.tensor(token_rows, dtype=torch.int64, device=device),
            block_ids=meta.block_table[rows.to(device), :n_blocks].to(torch.int64),
            kv_len=kv_len,
            mask=mask,
            lens=lens,
        )
    return plan


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._plan: _Plan | None = None
        self._block_size = 0

    def begin_forward(self, meta: AttentionMetadata) -> None:
        self._meta = None  # the plan depends on block_size, known at the first layer call

    def _plan_for(self, meta: AttentionMetadata, block_size: int) -> _Plan:
        # block_size 0 stands for "no KV cache" (profiling forward).
        if self._meta is not meta or self._block_size != block_size or self._plan is None:
            self._plan = _build_plan(meta, max(block_size, 1), block_size > 0)
            self._meta = meta
            self._block_size = block_size
        return self._plan

    def forward(self, q, k, v, kv_cache, meta, scale, kv_scales=None, *, window=0, sinks=None, chunk=0):
        n = meta.num_actual_tokens
        calibrate_if_armed(kv_scales, k, v, n)
        has_cache = kv_cache.numel() > 0
        block_size = kv_cache.shape[2] if has_cache else 0
        plan = self._plan_for(meta, block_size)
        out_scale = 1.0
        if has_cache:
            k_cache, v_cache = kv_cache[0], kv_cache[1]
            slots = meta.slot_mapping[:n]
            k_new, v_new = k[:n], v[:n]
            if is_fp8_kv_cache(kv_cache):
                k_scale, out_scale = (kv_scales.k_scale, kv_scales.v_scale) if kv_scales is not None else (1.0, 1.0)
                scale = scale * k_scale
                k_new, v_new = quantize_kv(k_new, k_scale), quantize_kv(v_new, out_scale)
                # torch has no index_copy_ for float8 types: copy the bytes.
                _store(k_cache.view(torch.uint8), slots, k_new.view(torch.uint8))
                _store(v_cache.view(torch.uint8), slots, v_new.view(torch.uint8))
                # This step's own rows as the cache holds them (a fresh prompt attends over these).
                k, v = k_new.to(q.dtype), v_new.to(q.dtype)
            else:
                _store(k_cache, slots, k_new)
                _store(v_cache, slots, v_new)
        out = None
        if plan.decode is None or plan.prefills or q.shape[0] != n:
            # Rows past num_actual_tokens (padding) are zeroed, never left as uninitialised memory.
            out = torch.empty_like(q) if q.shape[0] == n else torch.zeros_like(q)

        local = bool(window or chunk)  # a sliding window or an attention chunk limits what a query sees
        chunk_masks, decode_mask = plan.window_masks(window, q.device, chunk) if local else ([], None)
        for i, prefill in enumerate(plan.prefills):
            qc = q[prefill.start:prefill.end].transpose(0, 1)  # [H, q_len, D]
            mask = chunk_masks[i] if local else prefill.mask
            if prefill.context_len == 0:
                kc = k[prefill.start:prefill.end].transpose(0, 1)
                vc = v[prefill.start:prefill.end].transpose(0, 1)
                o = _sdpa(qc, kc, vc, mask, scale, self.softcap, sinks=sinks)
            else:
                kc = _gather(k_cache, prefill.block_ids, prefill.seq_len).to(q.dtype).transpose(0, 1)
                vc = _gather(v_cache, prefill.block_ids, prefill.seq_len).to(q.dtype).transpose(0, 1)
                o = _sdpa(qc, kc, vc, mask, scale, self.softcap, sinks=sinks)
            out[prefill.start:prefill.end] = o.transpose(0, 1) if out_scale == 1.0 else o.transpose(0, 1) * out_scale

        group = plan.decode
        if group is not None:
            qd = q[group.token_slice] if group.token_slice is not None else q.index_select(0, group.token_index)
            qd = qd[:, :, None, :]  # [B, H, 1, D]
            kd = _gather_batch(k_cache, group.block_ids, group.kv_len).to(q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
            vd = _gather_batch(v_cache, group.block_ids, group.kv_len).to(q.dtype).transpose(1, 2)
            o = _sdpa(qd, kd, vd, decode_mask if local else group.mask, scale, self.softcap, causal=False, sinks=sinks)
            o = o[:, :, 0, :]  # [B, H, D]
            if out_scale != 1.0:
                o = o * out_scale
            if out is None:  # decode-only step: the group's output is the whole output
                if group.token_slice is not None and group.token_slice.start == 0 and q.shape[0] == o.shape[0]:
                    return o
                out = torch.zeros_like(q)  # pragma: no cover (padding handled above)
            if group.token_slice is not None:
                out[group.token_slice] = o
            else:
                out.index_copy_(0, group.token_index, o)
        return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          softcap: float, *, causal: bool = True, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over [..., H, Lq, D] queries and [..., Hkv, Lk, D] keys/values (GQA); mask: True = attend,
    None with `causal`: a fresh chunk's own causal mask. With softcap (Gemma 2) the scores are capped
    before the softmax, and with sinks (gpt-oss: a logit per head [H] in every query's denominator,
    with no value) the softmax has an extra term, neither of which SDPA can do: the same math written
    out (float32 softmax)."""
    if not softcap and sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is None and causal:
        lq, lk = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)
    # The sink as one more key column whose value is zero: softmax over [scores | sink], drop its column.
    sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


def _store(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """rows [T, Hkv, D] into the cache plane [blocks, block_size, Hkv, D] at flat slot ids."""
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """[length, Hkv, D]: one sequence's KV, read block by block from the cache."""
    # index_select on a flat id vector is ~5x cheaper than advanced indexing for a handful of blocks.
    return cache.index_select(0, block_ids).flatten(0, 1)[:length]


def _gather_batch(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length, Hkv, D]: each row's KV padded to the longest (the mask hides the padding)."""
    b, n = block_ids.shape
    return cache.index_select(0, block_ids.reshape(-1)).view(b, n * cache.shape[1], *cache.shape[2:])[:, :length]
