"""Triton attention backend (CUDA): the KV write and one unified paged-attention launch per layer.

Same contract as the torch reference (attention/backend.py): write this step's k/v at
`meta.slot_mapping`, then attend every request of the mixed batch (prefill chunks and decodes
together, GQA, causal within a chunk) over its paged KV. Two kernel launches per layer, plus a
split-KV merge when the heuristic splits long contexts; nothing reads device memory on the host,
so a decode step can be captured in a CUDA graph (the runner passes max_seq_len as a fixed upper
bound and pads slot_mapping with -1). Its decode path runs one-token steps in fused
matrix-vector kernels (attention/fused_decode.py). An FP8 cache's scales (attention/kv_cache.py)
reach every kernel as the layer's float32 (k_scale, v_scale) device tensor, read by pointer.

Which kernel attends: a step whose longest query is shorter than PREFILL_MIN_QUERY_LEN (decode
steps, short chunks, speculative verification) runs the unified kernel (kernels/paged_attention.py,
split-KV for long contexts). A step with a prefill chunk at least that long runs the prefill
kernel (kernels/prefill_attention.py, large tensor-core tiles) for its requests; the one-token
requests that lead a mixed batch (the scheduler puts decodes first) still go to the unified
kernel, so their single query row does not occupy a whole 128- or 256-row query tile. The split is planned once per
step from the metadata's host copies, never from device data.

Long chunks on Hopper: the prefill requests of such a step whose chunk is at least FA3_MIN_LEN
tokens long attend through FlashAttention-3 instead, one request at a time (kernels/fa3_prefill.py,
~1.1-1.3x cuDNN's rate); where its wheel is missing, those whose chunk and cached context are both 0
or at least CUDNN_MIN_LEN tokens long attend through cuDNN (kernels/cudnn_prefill.py: ~1.4x the
prefill kernel's rate at long contexts). The shorter ones beside them keep the prefill kernel, one
launch per run of consecutive requests. Only in `forward`, which runs after this step's k/v rows
are in the cache (cuDNN takes a 16-bit cache's own rows from k/v); with a sliding window, attention
sinks (gpt-oss), attention chunks (Llama 4) or a score cap the Triton kernels keep them, and so do
decodes that would otherwise take the CUDA decode kernel.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ferrox.attention.backend import AttentionBackend
from ferrox.attention.decode_path import DecodePath, OneTokenLayer
from ferrox.attention.fused_decode import FusedOneTokenDecode
from ferrox.attention.kv_cache import KVCacheScales
from ferrox.attention.kv_scale_calibration import calibrate_if_armed
from ferrox.attention.metadata import AttentionMetadata
from ferrox.kernels import cudnn_prefill, fa3_prefill
from ferrox.kernels.paged_attention import unified_attention
from ferrox.kernels.prefill_attention import prefill_attention
from ferrox.kernels.reshape_and_cache import reshape_and_cache

logger = logging.getLogger(__name__)

# Steps whose longest query reaches this many tokens attend with the prefill kernel (see above).
# Chunks shorter than this fill little of the prefill kernel's tall query tiles (256 rows = 64
# tokens x 4 heads on Hopper); they keep the unified kernel's 64-row tiles. Measured only from
# 512-token chunks up (benches/bench_kernels.py), so the cut is conservative.
PREFILL_MIN_QUERY_LEN = 128


@dataclass(frozen=True, slots=True)
class _StepPlan:
    """How one step's requests are divided between the two kernels."""

    num_decodes: int  # leading one-token requests (rows 0..num_decodes) for the unified kernel
    use_prefill_kernel: bool  # the remaining requests go to the prefill kernel
    prefill_query_start_loc: torch.Tensor  # query_start_loc[num_decodes:] - num_decodes, on device
    # The requests after the decodes that take FlashAttention-3 or cuDNN (see the module doc): per
    # request, its index, first row, first row past it, cached context length and blocks holding that
    # context.
    long_requests: tuple[tuple[int, int, int, int, int], ...] = ()
    # With such requests, the other requests after the decodes as runs of consecutive requests for
    # the prefill kernel: (first request, request past the run, first row, row past the run).
    prefill_runs: tuple[tuple[int, int, int, int], ...] = ()


def _plan_step(meta: AttentionMetadata, block_size: int = 0,
               takes_long_path: Callable[[int, int], bool] = cudnn_prefill.takes_cudnn_path) -> _StepPlan:
    """block_size: the cache's, when a long-chunk path is on for this backend (0: off);
    takes_long_path(query_len, context_len): whether that path takes a request."""
    if meta.max_query_len < PREFILL_MIN_QUERY_LEN:
        return _StepPlan(0, False, meta.query_start_loc)
    starts = meta.query_start_loc_cpu.tolist()
    query_lens = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    shifted = meta.query_start_loc[num_decodes:] - num_decodes if num_decodes else meta.query_start_loc
    if not block_size:
        return _StepPlan(num_decodes, True, shifted)
    seq_lens = meta.seq_lens_cpu.tolist()
    long: list[tuple[int, int, int, int, int]] = []
    runs: list[list[int]] = []  # [first request, request past the run]
    for r in range(num_decodes, len(query_lens)):
        context = seq_lens[r] - query_lens[r]
        if takes_long_path(query_lens[r], context):
            long.append((r, starts[r], starts[r + 1], context, -(-context // block_size)))
        elif runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    if not long:
        return _StepPlan(num_decodes, True, shifted)
    return _StepPlan(num_decodes, True, shifted, tuple(long),
                     tuple((r0, r1, starts[r0], starts[r1]) for r0, r1 in runs))


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cached_kv = True
    # `forward` can be split out of a captured forward and run on its own into a given `out`
    # (worker/piecewise_graphs.py): nothing it launches depends on what the graphs replay around it.
    supports_piecewise_graphs = True

    def __init__(self) -> None:
        # Set by worker/piecewise_graphs.py while it captures a forward in pieces: `forward` hands
        # each layer's call to it instead of attending.
        self.piecewise: Callable[..., torch.Tensor] | None = None
        self._meta: AttentionMetadata | None = None
        self._plan: _StepPlan | None = None
        # The long-chunk path: decided at the first forward with a cache (device, dtype, heads).
        self._long_block_size: int | None = None
        self._long_kernel = "cudnn"  # or "fa3" (kernels/fa3_prefill.py), when _long_block_size is set
        self._long_shape: tuple[int, int, int, torch.dtype, torch.device] | None = None
        # Chunks of exactly this many tokens have exact-shape cuDNN plans (warm_up_plans); 0: none.
        self._cudnn_exact_chunk = 0
        self._torch: AttentionBackend | None = None  # the reference, for steps with bidirectional ranges

    def begin_forward(self, meta: AttentionMetadata) -> None:
        self._plan_for(meta)

    def _reference(self) -> AttentionBackend:
        from ferrox.attention.torch_backend import TorchAttentionBackend

        if self._torch is None:
            self._torch = TorchAttentionBackend()
        self._torch.softcap = self.softcap
        return self._torch

    def _plan_for(self, meta: AttentionMetadata) -> _StepPlan:
        # Planned once per step (the first layer, or begin_forward) and reused by every layer.
        if self._meta is not meta or self._plan is None:
            takes = fa3_prefill.takes_fa3_path if self._long_kernel == "fa3" else cudnn_prefill.takes_cudnn_path
            self._plan = _plan_step(meta, self._long_block_size or 0, takes)
            self._meta = meta
        return self._plan

    def _decide_long_path(self, q: torch.Tensor, kv_cache: torch.Tensor, sinks: torch.Tensor | None = None) -> None:
        if self._long_block_size is not None:
            return
        # (Neither library path takes a score cap or sinks here: a softcap model, or one whose first layer
        # has sinks (gpt-oss: every layer), keeps the Triton prefill kernel, and builds no cuDNN plans.)
        device, dtype, head_dim = q.device, q.dtype, q.shape[2]
        plain = not self.softcap and sinks is None and self.uniform_heads
        if plain and fa3_prefill.fa3_prefill_applies(device, dtype, kv_cache.dtype, head_dim):
            self._long_kernel, on = "fa3", True
        else:
            self._long_kernel = "cudnn"
            on = (plain and cudnn_prefill.cudnn_prefill_applies(device, dtype, kv_cache.dtype, head_dim)
                  and cudnn_prefill.enable_bucketed_plans())
        self._long_block_size = kv_cache.shape[2] if on else 0
        if on:
            self._long_shape = (q.shape[1], kv_cache.shape[3], head_dim, dtype, device)
        logger.info("long prefill chunks (>= %d tokens): %s", cudnn_prefill.CUDNN_MIN_LEN,
                    ("FlashAttention-3" if self._long_kernel == "fa3" else "cuDNN attention") if on
                    else "the Triton prefill kernel")
        self._plan = None  # re-plan this step with the decision made

    def warm_up_plans(self, max_query_len: int, max_model_len: int) -> int:
        """Build the cuDNN plans every long chunk can reach (worker/warmup.py, before ready); the
        number built, 0 when the path is off or no step has run yet. FlashAttention-3 builds none:
        its kernels are loaded by a few calls instead."""
        if not self._long_block_size or self._long_shape is None:
            return 0
        heads, kv_heads, head_dim, dtype, device = self._long_shape
        if self._long_kernel == "fa3":
            calls = fa3_prefill.warm_up(device, dtype, heads, kv_heads, head_dim, max_query_len)
            logger.info("FlashAttention-3 kernels loaded (%d calls)", calls)
            return 0
        try:
            built = cudnn_prefill.warm_up_plans(device, dtype, heads, kv_heads, head_dim, max_query_len,
                                                max_model_len)
        except RuntimeError as exc:
            logger.warning("cuDNN attention plans failed to build (%s); long prefill chunks use the Triton "
                           "prefill kernel", exc)
            self._long_block_size = 0
            self._plan = None
            return 0
        try:  # whole chunks' exact plans: an extra (~5%), not a condition of the path
            exact = cudnn_prefill.warm_up_exact_plans(device, dtype, heads, kv_heads, head_dim, max_query_len,
                                                      max_model_len)
        except RuntimeError as exc:
            logger.warning("cuDNN exact-shape attention plans failed to build (%s); whole chunks take their "
                           "length buckets", exc)
            return built
        self._cudnn_exact_chunk = max_query_len if exact else 0
        return built + exact

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVCacheScales | None = None,
        out: torch.Tensor | None = None,
        *,
        window: int = 0,
        sinks: torch.Tensor | None = None,
        chunk: int = 0,
    ) -> torch.Tensor:
        """out: where the result goes (q's shape; a new tensor when None). window: the layer's sliding
        window (0: full attention; the Triton kernels mask it, cuDNN and the CUDA decode kernel step aside).
        sinks: the layer's attention sinks (float32 [H]; likewise). chunk: the layer's attention chunk
        (Llama 4; 0: none; likewise)."""
        calibrate_if_armed(kv_scales, k, v, meta.num_actual_tokens)
        if self.piecewise is not None:
            if chunk:  # (the piecewise sites carry no chunk: such models capture no piecewise graphs)
                raise ValueError("piecewise CUDA graphs do not take chunked attention layers")
            return self.piecewise(q, k, v, kv_cache, meta, scale, kv_scales, window=window, sinks=sinks)
        if meta.bidirectional:
            # Gemma 3's image tokens attend to each other both ways, which the kernels do not mask: such
            # a step (an image's prefill; eager) runs the torch reference over the same cache.
            result = self._reference().forward(q, k, v, kv_cache, meta, scale, kv_scales, window=window, sinks=sinks,
                                               chunk=chunk)
            return result if out is None else out.copy_(result)
        if kv_cache.numel() == 0:
            return self._forward_without_cache(q, k, v, meta, scale, window, sinks, chunk)
        if meta.slot_mapping.shape[0] > k.shape[0]:
            raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} slots for {k.shape[0]} k/v rows")
        kv_scale = kv_scales.scales if kv_scales is not None else None
        reshape_and_cache(k, v, kv_cache, meta.slot_mapping, kv_scale)
        self._decide_long_path(q, kv_cache, sinks)
        plan = self._plan_for(meta)
        # (Neither library path takes a sliding window, sinks or chunks: such layers keep the Triton kernels.)
        if plan.long_requests and not window and not chunk and sinks is None:
            try:
                return self._attend_long(q, k, v, kv_cache, meta, plan, scale, out, kv_scales)
            except RuntimeError as exc:
                # A library refusing a shape (cuDNN with no plan for it) must not fail the step's
                # requests: this backend keeps the Triton kernels from now on, this step included.
                logger.warning("%s failed (%s); long prefill chunks use the Triton prefill kernel from now on",
                               "FlashAttention-3" if self._long_kernel == "fa3" else "cuDNN attention", exc)
                self._long_block_size = 0
                self._plan = None
        return self._attend(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, meta,
                            meta.max_seq_len, scale, kv_scale, out, window, sinks, chunk)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               kv_scales: KVCacheScales | None = None, *, window: int = 0,
               sinks: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        return self._attend(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, meta,
                            meta.max_seq_len, scale, kv_scales.scales if kv_scales is not None else None,
                            window=window, sinks=sinks, chunk=chunk)

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                block_table: torch.Tensor, meta: AttentionMetadata, max_seq_len: int, scale: float,
                kv_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                window: int = 0, sinks: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        """kv_scale: an FP8 cache's float32 (k_scale, v_scale), read by the kernels on the device."""
        plan = self._plan_for(meta)
        softcap = self.softcap
        if not plan.use_prefill_kernel:
            return unified_attention(q, kv_cache, query_start_loc, seq_lens, block_table,
                                     max_query_len=meta.max_query_len, max_seq_len=max_seq_len, scale=scale, out=out,
                                     kv_scale=kv_scale, softcap=softcap, window=window, sinks=sinks, chunk=chunk)
        nd = plan.num_decodes
        if nd == 0:
            return prefill_attention(q, kv_cache, query_start_loc, seq_lens, block_table, scale=scale, out=out,
                                     kv_scale=kv_scale, softcap=softcap, window=window, sinks=sinks, chunk=chunk)
        if out is None:
            out = torch.empty_like(q)
        unified_attention(q[:nd], kv_cache, query_start_loc[: nd + 1], seq_lens[:nd], block_table[:nd],
                          max_query_len=1, max_seq_len=max_seq_len, scale=scale, out=out[:nd], kv_scale=kv_scale,
                          softcap=softcap, window=window, sinks=sinks, chunk=chunk)
        prefill_attention(q[nd:], kv_cache, plan.prefill_query_start_loc, seq_lens[nd:], block_table[nd:],
                          scale=scale, out=out[nd:], kv_scale=kv_scale, softcap=softcap, window=window, sinks=sinks,
                          chunk=chunk)
        return out

    def _attend_long(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata, plan: _StepPlan, scale: float,
                     out: torch.Tensor | None = None, kv_scales: KVCacheScales | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty_like(q)
        kv_scale = kv_scales.scales if kv_scales is not None else None
        nd = plan.num_decodes
        if nd:
            unified_attention(q[:nd], kv_cache, meta.query_start_loc[: nd + 1], meta.seq_lens[:nd],
                              meta.block_table[:nd], max_query_len=1, max_seq_len=meta.max_seq_len, scale=scale,
                              out=out[:nd], kv_scale=kv_scale)
        for r0, r1, a, b in plan.prefill_runs:  # shorter chunks beside the long ones
            prefill_attention(q[a:b], kv_cache, meta.query_start_loc[r0:r1 + 1] - a, meta.seq_lens[r0:r1],
                              meta.block_table[r0:r1], scale=scale, out=out[a:b], kv_scale=kv_scale)
        # An FP8 cache: the kernel reads the chunk's own rows from the cache too (their blocks as well),
        # with the scales as host numbers (no device read per layer). FlashAttention-3 always does.
        fp8 = kv_cache.dtype != q.dtype
        host_scales = (kv_scales.k_scale, kv_scales.v_scale) if kv_scales is not None else (1.0, 1.0)
        block_size = kv_cache.shape[2]
        if self._long_kernel == "fa3":
            for r, a, b, context, _ in plan.long_requests:
                fa3_prefill.fa3_prefill_request(out[a:b], q[a:b], kv_cache,
                                                meta.block_table[r, :-(-(context + b - a) // block_size)],
                                                context, scale, host_scales if fp8 else None)
            return out
        for r, a, b, context, blocks in plan.long_requests:
            exact = cudnn_prefill.takes_exact_plan(b - a, context, self._cudnn_exact_chunk)
            if fp8:
                blocks = -(-(context + b - a) // block_size)
            cudnn_prefill.cudnn_prefill_request(out[a:b], q[a:b], k[a:b], v[a:b], kv_cache,
                                                meta.block_table[r, :blocks], context, scale, exact,
                                                host_scales if fp8 else None)
        return out

    def decode_path(self, layers: Sequence[OneTokenLayer] | None,
                    rope_rows: Callable[[torch.Tensor], torch.Tensor],
                    q_scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DecodePath:
        """One-token steps in fused matrix-vector kernels (attention/fused_decode.py)."""
        return FusedOneTokenDecode(self, layers, rope_rows, q_scale)

    def _forward_without_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
        window: int = 0, sinks: torch.Tensor | None = None, chunk: int = 0,
    ) -> torch.Tensor:
        """No KV cache yet (the profiling forward): every request starts at position 0, so its KV is
        exactly its own k/v rows. View them as a cache of one-slot blocks, block id = token row, and
        run the same kernel, so profiling measures the memory the real path uses."""
        kv = torch.stack((k, v)).unsqueeze(2)  # [2, T, block_size=1, Hkv, D]
        query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        rows = torch.arange(max(meta.max_query_len, 1), dtype=torch.int32, device=q.device)
        block_table = (meta.query_start_loc[:-1, None] + rows[None, :]).to(torch.int32)
        return self._attend(q, kv, meta.query_start_loc, query_lens.to(torch.int32), block_table, meta,
                            meta.max_query_len, scale, window=window, sinks=sinks, chunk=chunk)
