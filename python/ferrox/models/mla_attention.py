"""Multi-head latent attention (MLA: DeepSeek-V2 / V3) over ferrox's paged KV cache, in the absorbed form.

DeepSeek's attention compresses a token's keys and values into one latent c_kv (kv_lora_rank dims, 512)
plus one shared rotary key k_pe (qk_rope_head_dim, 64); each head's key is [W_UK_h c_kv | k_pe] and its
value W_UV_h c_kv, W_UK / W_UV being the two halves of kv_b_proj's rows per head. Like vLLM, ferrox never
expands them: W_UK is absorbed into the query and W_UV applied after attention, so

    q_h     = [q_nope_h @ W_UK_h | rope(q_pe_h)]        (kv_lora_rank + qk_rope_head_dim dims)
    k = v   = [kv_a_layernorm(c_kv) | rope(k_pe)]       (the same, one "KV head" shared by all heads)
    out_h   = W_UV_h @ attention(q_h, k, v)[:kv_lora_rank]

with the softmax scale of the unabsorbed scores (q_nope . k_nope + q_pe . k_pe are unchanged). Every
request then attends MQA-style (H query heads over one KV head of 576 dims for V2/V3), in prefill and
decode alike, through the layer's backend (`mla_backend`):

- the Triton kernel set (CUDA; the interpreter in tests): `MlaTritonBackend`, the latent attention kernels
  of kernels/mla_attention.py (the two-part 512 + 64 score, many heads a program, split-KV decode). It
  reads only device tensors and plans nothing on the host, so the model keeps the decode CUDA graphs
  (worker/cuda_graphs.py), and it takes the piecewise graphs' hook (worker/piecewise_graphs.py) as the
  Triton backend does: every kernel launch of attention happens inside `backend.forward`, which the
  piecewise runner calls between graph pieces with the step's own metadata.
  Long prefill chunks of an eager step on Hopper take the expanded form instead (kernels/mla_prefill.py:
  each cached latent expanded into the heads' own 192-dim keys and 128-dim values, FlashAttention-3
  over them, 3.4x fewer FLOPs than absorbed); `MlaTritonBackend.expanded_requests` plans them, the
  backend attends the step's other requests absorbed, and the layer these.
- the torch kernel set (the CPU): the reference torch backend over the same cache.

The cache: one plane, [1, blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim] (ModelSpec.kv_planes,
loader/model_config.py): the value is the row's first kv_lora_rank dims, so no V plane is stored. The
backends take it as [2, ...] with both planes the same memory (`_as_key_and_value`): the torch backend's V
write stores the same row again in place; the Triton kernels read and write plane 0 only. ~70x less than
V3's full per-head K/V (128 heads x (192 + 128) dims against 576 dims a token).

Rotary: DeepSeek rotates (x0, x1), (x2, x3), ... pairs ("interleaved": every V2, and V3 unless
config.json says rope_interleave false); ferrox's rotary kernels turn (i, i + d/2) pairs. q_pe and k_pe
are laid out evens-then-odds before rotating: the same permutation of both leaves every q . k unchanged,
and nothing else reads them.

Llama 4's query scaling (Mistral 4: models/mistral4.py) arrives as the step's rope (`QueryScaledRope`): q_pe
turns with the rope inside it, then q_nope and q_pe both take the token's factor before the absorption, so
the absorbed query of every path (torch, Triton, CUDA graphs) and the expanded prefill's carry it: a
per-token factor on the logits, as transformers scales the whole query.

Tensor parallelism (as vLLM shards MLA): the query heads split across the ranks. q_proj / q_b_proj and
kv_b_proj are column-parallel by heads (`HeadParallelLinear`: rank r holds heads [r H/N, (r+1) H/N), so
its W_UK / W_UV are those heads' halves of kv_b_proj), o_proj row-parallel over the same heads (one
all-reduce). q_a_proj, kv_a_proj_with_mqa and their norms are replicated: the latent is every head's, so
every rank computes it and caches the same one-plane latent row a token for its own heads (the KV-cache
sizing counts one latent "KV head" a rank: attention/kv_cache.py, local_num_kv_heads).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend, get_attention_backend
from ferrox.attention.kv_cache import KVCacheScales
from ferrox.attention.kv_scale_calibration import calibrate_if_armed
from ferrox.attention.metadata import AttentionMetadata
from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import Weight, even_split
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import Linear, MergedLinear, RowParallelLinear
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.ministral3 import QueryScaledRope

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class MlaShape:
    """The MLA dimensions of a config (read and checked by models/deepseek_v2.py)."""

    kv_lora_rank: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (DeepSeek-V2-Lite)
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved: bool  # rotary pairs (x0, x1), (x2, x3), ... (module docstring)
    scale: float  # softmax scale: qk_head_dim ** -0.5, times YaRN's mscale_all_dim factor squared


class MlaTritonBackend(AttentionBackend):
    """The latent attention kernels (kernels/mla_attention.py) behind the backend interface: `forward`
    writes the step's latent rows into the K plane and attends every request of the step (prefill chunks
    and decodes in one launch, plus a split merge for long decodes). q [T, H, D], k the rows [T, 1, D] (v,
    the same rows, is not read: the value is the row's first kv_lora_rank dims); the result is
    [T, H, kv_lora_rank], or the first kv_lora_rank columns of a given `out` (the piecewise graphs'
    q-shaped buffer), which MlaAttention reads as o[..., :kv_lora_rank] either way."""

    name = "mla-triton"
    # `forward` can run between piecewise graph pieces on its own (worker/piecewise_graphs.py): all it
    # launches reads the step's metadata, nothing captured around it.
    supports_piecewise_graphs = True

    # A step whose longest query reaches this many tokens attends its leading one-token requests (the
    # scheduler puts decodes first) in a launch of their own, with the decode tiles (one token, many heads a
    # program) instead of the prefill tiles, where a decode row would leave most of its tile masked off.
    # Planned from the metadata's host copies, once a step: never inside a CUDA graph (the decode graphs
    # have one-token queries, the verify graphs a few tokens).
    SEPARATE_DECODES_QUERY_LEN = 128

    def __init__(self, mla: MlaShape) -> None:
        self.mla = mla
        self.kv_lora_rank = mla.kv_lora_rank
        # The expanded prefill path (kernels/mla_prefill.py): decided at the first forward with a cache.
        self._expand: bool | None = None
        self._expanded: tuple[AttentionMetadata | None, tuple[tuple[int, int, int, int], ...]] = (None, ())
        # Set by worker/piecewise_graphs.py while it captures a forward in pieces: `forward` hands each
        # layer's call to it instead of attending.
        self.piecewise: Callable[..., torch.Tensor] | None = None
        self._meta: AttentionMetadata | None = None
        self._device: tuple[int, torch.device, torch.dtype] | None = None  # (heads, device, dtype) once a step ran
        # The step's plan: (leading decodes, query_start_loc of the requests after them, from row 0).
        self._plan: tuple[int, torch.Tensor | None] = (0, None)

    def begin_forward(self, meta: AttentionMetadata) -> None:
        self._plan_for(meta)

    def _plan_for(self, meta: AttentionMetadata) -> tuple[int, torch.Tensor | None]:
        if self._meta is not meta:
            self._meta, self._plan = meta, (0, None)
            # (Never while a CUDA graph is captured: the plan's device tensor would be the capture's. One
            # launch for the whole step is as correct, only slower for the decode rows.)
            from ferrox.kernels.mla_attention import graph_capturing

            capturing = graph_capturing(meta.query_start_loc)
            if meta.max_query_len >= self.SEPARATE_DECODES_QUERY_LEN and not capturing:
                starts = meta.query_start_loc_cpu.tolist()
                decodes = 0
                while decodes + 1 < len(starts) and starts[decodes + 1] - starts[decodes] == 1:
                    decodes += 1
                if decodes:
                    self._plan = (decodes, meta.query_start_loc[decodes:] - decodes)
        return self._plan

    def expanded_requests(self, meta: AttentionMetadata, dtype: torch.dtype,
                          kv_cache: torch.Tensor) -> tuple[tuple[int, int, int, int], ...]:
        """The requests of this step whose chunks take the expanded form (kernels/mla_prefill.py): (request,
        first row, row past it, cached context); () when the path is off here or the forward is being
        captured (a graph replays the absorbed kernels it captured)."""
        if self._expand is False or self.piecewise is not None or kv_cache.numel() == 0 or meta.bidirectional:
            return ()  # (every layer of every step asks: the common answers come first)
        from ferrox.kernels import mla_prefill
        from ferrox.kernels.mla_attention import graph_capturing

        if self._expand is None:
            mla = self.mla
            self._expand = mla_prefill.expanded_supported(kv_cache.device, dtype, kv_cache.dtype,
                                                          mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim)
            logger.info("long MLA prefill chunks (>= %d tokens): %s", mla_prefill.EXPANDED_MIN_LEN,
                        "expanded, FlashAttention-3" if self._expand else "absorbed, the Triton MLA kernels")
        if not self._expand or graph_capturing(meta.query_start_loc):
            return ()
        if self._expanded[0] is not meta:
            self._expanded = (meta, mla_prefill.plan_expanded(meta))
        return self._expanded[1]

    def warm_up_plans(self, max_query_len: int, max_model_len: int) -> int:
        """Load the expanded path's FlashAttention-3 kernels before ready (worker/warmup.py); it builds no
        plans, so 0."""
        from ferrox.kernels import mla_prefill

        if self._expand and self._device is not None and max_query_len >= mla_prefill.EXPANDED_MIN_LEN:
            mla = self.mla
            heads, device, dtype = self._device
            mla_prefill.warm_up(device, dtype, heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim)
        return 0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, kv_scales: KVCacheScales | None = None,
                out: torch.Tensor | None = None, *, window: int = 0,
                sinks: torch.Tensor | None = None, chunk: int = 0,
                skip: tuple[tuple[int, int, int, int], ...] = ()) -> torch.Tensor:
        """skip: requests (`expanded_requests`) this call leaves unattended: their rows of the result are
        not written (the layer attends them expanded)."""
        calibrate_if_armed(kv_scales, k, v, meta.num_actual_tokens)
        if self.piecewise is not None:
            return self.piecewise(q, k, v, kv_cache, meta, scale, kv_scales, window=window, sinks=sinks)
        from ferrox.kernels.mla_attention import mla_attention, write_latent

        if window or chunk or sinks is not None or self.softcap or meta.bidirectional:
            raise ValueError("the MLA kernels have no sliding window, attention chunks, sinks, softcap or "
                             "bidirectional ranges")
        rank = self.kv_lora_rank
        if kv_cache.numel() == 0:
            # No cache yet (the profiling forward): every request starts at position 0, so its KV is its own
            # rows; view them as a cache of one-slot blocks (block id = token row) and run the same kernel.
            t, dim = k.shape[0], k.shape[-1]
            cache = k.reshape(1, t, 1, 1, dim).expand(2, t, 1, 1, dim)
            rows = torch.arange(max(meta.max_query_len, 1), dtype=torch.int32, device=q.device)
            starts = meta.query_start_loc
            block_table = (starts[:-1, None] + rows[None, :]).to(torch.int32)
            query_lens = (starts[1:] - starts[:-1]).to(torch.int32)
            return mla_attention(q, cache, starts, query_lens, block_table, kv_lora_rank=rank,
                                 max_query_len=meta.max_query_len, max_seq_len=meta.max_query_len, scale=scale,
                                 out=out)
        kv_scale = kv_scales.scales if kv_scales is not None else None
        write_latent(k, kv_cache, meta.slot_mapping, kv_scale)
        if self._device is None:  # (for warm_up_plans)
            self._device = (q.shape[1], q.device, q.dtype)
        if skip:
            return self._attend_others(q, kv_cache, meta, skip, scale, kv_scale)
        decodes, rest_starts = self._plan_for(meta)
        if not decodes:
            return mla_attention(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, kv_lora_rank=rank,
                                 max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=scale,
                                 out=out, kv_scale=kv_scale)
        assert rest_starts is not None
        if out is None:
            out = torch.empty(q.shape[0], q.shape[1], rank, dtype=q.dtype, device=q.device)
        mla_attention(q[:decodes], kv_cache, meta.query_start_loc[:decodes + 1], meta.seq_lens[:decodes],
                      meta.block_table[:decodes], kv_lora_rank=rank, max_query_len=1, max_seq_len=meta.max_seq_len,
                      scale=scale, out=out[:decodes], kv_scale=kv_scale)
        mla_attention(q[decodes:], kv_cache, rest_starts, meta.seq_lens[decodes:], meta.block_table[decodes:],
                      kv_lora_rank=rank, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=scale,
                      out=out[decodes:], kv_scale=kv_scale)
        return out[..., :rank]

    def _attend_others(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       skip: tuple[tuple[int, int, int, int], ...], scale: float,
                       kv_scale: torch.Tensor | None) -> torch.Tensor:
        """Every request but the skipped ones, one absorbed launch per run of consecutive requests."""
        from ferrox.kernels.mla_attention import mla_attention

        rank = self.kv_lora_rank
        out = torch.empty(q.shape[0], q.shape[1], rank, dtype=q.dtype, device=q.device)
        starts = meta.query_start_loc_cpu.tolist()
        skipped = {r for r, *_ in skip}
        num_reqs, r0 = len(starts) - 1, 0
        while r0 < num_reqs:
            if r0 in skipped:
                r0 += 1
                continue
            r1 = r0
            while r1 < num_reqs and r1 not in skipped:
                r1 += 1
            a, b = starts[r0], starts[r1]
            longest = max(starts[r + 1] - starts[r] for r in range(r0, r1))
            mla_attention(q[a:b], kv_cache, meta.query_start_loc[r0:r1 + 1] - a, meta.seq_lens[r0:r1],
                          meta.block_table[r0:r1], kv_lora_rank=rank, max_query_len=longest,
                          max_seq_len=meta.max_seq_len, scale=scale, out=out[a:b], kv_scale=kv_scale)
            r0 = r1
        return out


def _as_key_and_value(kv_cache: torch.Tensor) -> torch.Tensor:
    """The one-plane latent cache (ModelSpec.kv_planes 1: loader/model_config.py) as the backends' [2, ...] K / V
    layout, both planes the same memory: the value is the key row, so the torch backend's V write stores the
    same row again in place and its V reads are the K rows; the Triton kernels read and write plane 0 only."""
    if kv_cache.numel() == 0 or kv_cache.shape[0] == 2:
        return kv_cache
    return kv_cache.expand(2, -1, -1, -1, -1)


def mla_backend(device: torch.device | str, kernels: str, mla: MlaShape) -> AttentionBackend:
    """The latent attention's backend for a model built with kernel set `kernels` (models/deepseek_v2.py):
    the Triton MLA kernels with "triton", the torch reference otherwise."""
    if kernels == "triton":
        return MlaTritonBackend(mla)
    return get_attention_backend(device, "torch")


class HeadParallelLinear(MergedLinear):
    """A projection whose output rows are `per_head` rows a head, column-parallel by heads: rank r of N holds
    heads [r H/N, (r+1) H/N) (num_heads: this rank's count). One shard, "heads", so a quantized method cuts
    its rows and block scales as a merged layer's (a block-FP8 cut inside a block is refused by name:
    layers/quant/fp8_block.py); loaded and keyed as a plain layer (no `#shard` in its checkpoint keys)."""

    SHARD = "heads"

    def __init__(self, in_features: int, num_heads: int, per_head: int, *, dtype: torch.dtype,
                 device: torch.device | str | None = None):
        tp = get_tp_group()
        start, heads = even_split(num_heads, tp.size, tp.rank, "num_attention_heads")
        self.num_heads = heads
        rows = (start * per_head, heads * per_head, num_heads * per_head)
        self._init_shards(in_features, {self.SHARD: rows}, bias=False, dtype=dtype, device=device)

    def load_weight(self, param_name: str, tensor: Weight, shard: str | None = None) -> None:
        super().load_weight(param_name, tensor, shard or self.SHARD)

    def checkpoint_keys(self, name: str) -> set[str]:
        return {key.removesuffix(f"#{self.SHARD}") for key in super().checkpoint_keys(name)}


def _evens_then_odds(x: torch.Tensor) -> torch.Tensor:
    """[..., d] interleaved rotary pairs -> [x0, x2, ..., x1, x3, ...] (a new tensor)."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


class MlaAttention(nn.Module):
    """One layer's latent attention; checkpoint names as DeepSeek's (q_proj or q_a_proj / q_a_layernorm /
    q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj)."""

    w_uk: torch.Tensor | None  # [H, qk_nope_head_dim, kv_lora_rank]: set by absorb_kv_b()
    w_uv: torch.Tensor | None  # [H, kv_lora_rank, v_head_dim]

    def __init__(self, spec: ModelSpec, mla: MlaShape, backend: AttentionBackend, ops: DeviceOps, dtype, device):
        super().__init__()
        self.mla = mla
        heads = spec.num_heads  # (all of them: the layers below hold this rank's share)
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        bias = spec.attention_bias  # (as transformers: q_a_proj, kv_a_proj_with_mqa and o_proj only)
        # Under tensor parallelism the head-parallel layers hold this rank's heads; the latent projections
        # (q_a_proj, kv_a_proj_with_mqa) and their norms are replicated (module docstring).
        if mla.q_lora_rank is None:  # DeepSeek-V2-Lite
            self.q_proj: HeadParallelLinear | None = HeadParallelLinear(spec.hidden_size, heads, qk_head_dim,
                                                                        dtype=dtype, device=device)
            self.q_a_proj = self.q_b_proj = None
            self.q_a_layernorm: RMSNorm | None = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(spec.hidden_size, mla.q_lora_rank, bias=bias, dtype=dtype, device=device)
            # (transformers builds the two latent norms with its default eps, 1e-6, not rms_norm_eps.)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6, dtype, device, ops)
            self.q_b_proj = HeadParallelLinear(mla.q_lora_rank, heads, qk_head_dim, dtype=dtype, device=device)
        self.kv_a_proj_with_mqa = Linear(spec.hidden_size, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=bias,
                                         dtype=dtype, device=device)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6, dtype, device, ops)
        # Loaded as a layer (a quantized checkpoint's method takes its tensors), then split into w_uk / w_uv
        # by absorb_kv_b and emptied: it is never run as a projection.
        self.kv_b_proj = HeadParallelLinear(mla.kv_lora_rank, heads, mla.qk_nope_head_dim + mla.v_head_dim,
                                            dtype=dtype, device=device)
        self.num_heads = self.kv_b_proj.num_heads  # this rank's
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, spec.hidden_size, bias=bias, dtype=dtype,
                                        device=device)
        self.register_buffer("w_uk", None, persistent=False)
        self.register_buffer("w_uv", None, persistent=False)
        self.backend = backend
        self.scale = mla.scale
        self.kv_scales = KVCacheScales(device)  # an FP8 cache's scales: 1.0 (checkpoints give MLA none)

    def absorb_kv_b(self, dtype: torch.dtype) -> None:
        """After loading (and the layers' finalize_quantized): kv_b_proj's weight, dequantized if its
        checkpoint was quantized, split per head into W_UK and W_UV (this rank's heads: kv_b_proj holds only
        their rows); kv_b_proj's own storage is freed."""
        layer = self.kv_b_proj
        if layer.quant is None:
            weight = layer.weight.data
        else:
            dequantize = getattr(layer.quant, "dequantize", None)
            if dequantize is None:
                raise UnsupportedModelError(f"kv_b_proj quantized as {type(layer.quant).__name__} cannot be "
                                            "absorbed into the latent attention (FP8 layouts can)")
            weight = dequantize(dtype)
        mla = self.mla
        per_head = weight.reshape(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        self.w_uk = per_head[:, :mla.qk_nope_head_dim].to(dtype).contiguous()
        self.w_uv = per_head[:, mla.qk_nope_head_dim:].transpose(1, 2).to(dtype).contiguous()
        layer.quant = None
        layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        if self.w_uk is None or self.w_uv is None:
            raise RuntimeError("MlaAttention.absorb_kv_b was not called after loading the weights")
        t, mla, heads = x.shape[0], self.mla, self.num_heads
        q_scale = None
        if isinstance(rope, QueryScaledRope):  # Llama 4's query scaling (Mistral 4): the whole query, below
            q_scale = rope.q_scale
            rope = rope.rope
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        q_nope, q_pe = q[..., :mla.qk_nope_head_dim], q[..., mla.qk_nope_head_dim:]
        latent = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(latent[:, :mla.kv_lora_rank])
        k_pe = latent[:, None, mla.kv_lora_rank:]
        if mla.interleaved:
            q_pe, k_pe = _evens_then_odds(q_pe), _evens_then_odds(k_pe)
        q_pe, k_pe = rope.rotate(q_pe, k_pe)  # (the Triton kernel turns them in place)
        if q_scale is not None:
            # Both parts, before the absorption: every path below (absorbed, expanded, graphs) reads them.
            factor = q_scale[:, None, None]
            q_nope, q_pe = (q_nope * factor).to(q.dtype), (q_pe * factor).to(q.dtype)
        # W_UK absorbed into the query: [H, T, nope] @ [H, nope, rank] -> [H, T, rank].
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        q_full = torch.cat((q_latent, q_pe.to(q_latent.dtype)), dim=-1)  # [T, H, rank + rope]
        kv = torch.cat((c_kv, k_pe[:, 0].to(c_kv.dtype)), dim=-1)[:, None, :]  # [T, 1, rank + rope]
        cache = _as_key_and_value(kv_cache)
        backend = self.backend
        # (The torch backend returns [T, H, rank + rope], the Triton kernels [T, H, rank] or a q-shaped buffer.)
        if isinstance(backend, MlaTritonBackend):
            # Long chunks' rows of o are left unwritten: they are attended expanded below.
            expanded = backend.expanded_requests(meta, q_nope.dtype, cache)
            o = backend.forward(q_full, kv, kv, cache, meta, self.scale, self.kv_scales, skip=expanded)
        else:
            expanded = ()
            o = backend.forward(q_full, kv, kv, cache, meta, self.scale, self.kv_scales)
        # Values are the latent: each head's output through its W_UV, [H, T, rank] @ [H, rank, v].
        out = torch.bmm(o[..., :mla.kv_lora_rank].transpose(0, 1), self.w_uv)
        if expanded:
            from ferrox.kernels.mla_prefill import mla_prefill_request

            rows, block_size = out.transpose(0, 1), cache.shape[2]
            for r, a, b, context in expanded:
                blocks = meta.block_table[r, :-(-(context + b - a) // block_size)]
                mla_prefill_request(rows[a:b], q_nope[a:b], q_pe[a:b], cache, blocks, context, self.w_uk, self.w_uv,
                                    self.scale, self.kv_scales.k_scale)
        return self.o_proj(out.transpose(0, 1).reshape(t, heads * mla.v_head_dim))
