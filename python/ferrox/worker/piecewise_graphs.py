"""Piecewise CUDA graphs for short prefill and mixed steps: every op but attention replayed from
graphs captured per token count, attention run eagerly in between with the step's own metadata.

Why: a step that is not decode-only (a new prompt, or decodes with a prefill chunk beside them)
ran eagerly, one Python-issued launch per op. A 32-token Qwen3-30B-A3B prefill issued ~880
launches for ~6 ms of GPU work and took ~35 ms (benches/RESULTS.md, twenty-seventh session): the
host, not the GPU, set its time to first token, and a server's mixed steps paid the same.
Attention is the one op whose launch shape depends on the step's requests (their count, lengths,
which kernel takes which request), so it stays eager -- exact metadata, whichever kernel the
backend picks -- and everything else (norms, projections, rotary, MoE routing and experts, the
all-reduces) replays from graphs.

Capture, per token count T of a ladder (`token_ladder`: 8 ... 512, or 2048 for the models that set
`piecewise_graph_tokens`, at most max_num_batched_tokens):
the model's forward over a dummy prefill of T tokens runs once eagerly (Triton compiles, cuBLAS
picks its kernels), then again under capture, in L + 1 pieces for L attention layers. Both times
the backend hands each attention call to `_Recorder`, which copies q/k/v into static buffers
(`_AttentionBuffers`; one copy where they are adjacent views of a fused projection's output) and
returns the static attention output buffer as the layer's result (no attention runs, so capture
writes no KV); under capture it also ends the current piece's graph after the copies and begins
the next one, so o_proj onwards is captured reading that buffer. q/k/v and the output
are one set of buffers [max T, heads, head_dim] shared by every layer and every T: piece i + 1
reads layer i's output before layer i + 1's attention rewrites it, in stream order. (Holding each
layer's own q/k/v tensors instead would keep L of them alive per captured T: ~0.4-1 GB on 8B and
30B models.) All pieces of all T share one memory pool; one T's pieces always replay in capture
order, and no two T's replays interleave.

Replay (`run`) of a step of t tokens: the input ids and positions go to static buffers padded to
the next ladder size T (pad rows: token 0 at position 0); then piece 0 replays, layer 0's
attention runs on rows [:t] of the static q/k/v (KV written for the real rows only: the step's
own slot_mapping) into rows [:t] of the static output, piece 1 replays, ... The output rows of
the pad tokens are zeroed once per step and never written by attention, so every pad row carries
the same values through the layers (token 0's embedding, no attention): in an MoE layer they all
route alike, adding one token's experts at most. The result is rows [:t] of the last piece's
output (a static tensor: read it before the next step's replay).

Decode-only steps keep their whole-forward graphs (worker/cuda_graphs.py), which also capture
attention. FERROX_PIECEWISE_GRAPHS=0 turns these off (A/B measurements).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from ferrox.attention.metadata import AttentionMetadata
from ferrox.compilation_config import GraphPlan
from ferrox.worker.cuda_graphs import CAPTURE_ERROR_MODE, capture_guard, next_captured_size
from ferrox.worker.dummy_batch import min_prefill_blocks, prefill_step, upload_step
from ferrox.worker.step_inputs import Uploader

logger = logging.getLogger(__name__)

# Token counts captured, clipped to the engine's token budget (vLLM's default capture sizes reach 512
# too): above it a dense model's step is mostly GPU time (Llama-3.1-8B: a 1,024-token prefill 26-35 ms
# eagerly on an H200), so padding it up to a rung would cost about what its launches do. A model class
# whose eager steps stay host-bound further sets `piecewise_graph_tokens` (the MoE models: 2048). A step
# pads to the next rung: by less than half its tokens up to 512, by at most a quarter past 512.
MAX_PIECEWISE_TOKENS = 512
_LADDER = (8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048)


def _dummy_prompts(tokens: int) -> int:
    """Prompts of the dummy prefill a size is captured on: at most 128 tokens each, so its positions
    stay inside any context length the engine allows (a graph's shapes do not depend on them)."""
    return -(-tokens // 128)


def piecewise_graphs_enabled() -> bool:
    """FERROX_PIECEWISE_GRAPHS=0 turns the piecewise graphs off (A/B measurements)."""
    return os.environ.get("FERROX_PIECEWISE_GRAPHS", "1") != "0"


def token_ladder(max_num_batched_tokens: int, max_tokens: int = MAX_PIECEWISE_TOKENS) -> list[int]:
    """The captured token counts: the ladder up to min(max_tokens, max_num_batched_tokens), plus
    that bound itself when it falls between two rungs (every step up to it then has a graph)."""
    top = min(max_tokens, max_num_batched_tokens)
    if top < 1:
        return []
    sizes = [s for s in _LADDER if s < top]
    return sizes + [top]


def piecewise_capture_sizes(plan: GraphPlan, max_num_batched_tokens: int) -> list[int] | None:
    """The token counts a plan (ferrox/compilation_config.py) asks to capture piecewise: its explicit sizes up
    to the token budget, the ladder up to its largest size, or None for the ladder up to the model's top."""
    if plan.sizes is not None:
        return [s for s in plan.sizes if s <= max_num_batched_tokens]
    if plan.max_size is not None:
        return token_ladder(max_num_batched_tokens, plan.max_size)
    return None


@dataclass(slots=True)
class _Pieces:
    """One token count's capture: L + 1 graphs around L attention calls."""

    graphs: list[torch.cuda.CUDAGraph]
    sites: list[_Site]  # the attention call between graphs[i] and graphs[i + 1]
    hidden: torch.Tensor  # the forward's output [T, hidden] (static)


@dataclass(frozen=True, slots=True)
class _Site:
    """What one layer's attention call needs besides the step's metadata."""

    kv_cache: torch.Tensor
    scale: float
    kv_scales: Any
    window: int = 0  # the layer's sliding window (0: full attention)
    sinks: torch.Tensor | None = None  # the layer's attention sinks (gpt-oss; None: none)


class _AttentionBuffers:
    """The static attention inputs and output every layer and every captured size share: q, k and v
    as adjacent column blocks of one [rows, (H + 2 Hkv) D] buffer (the layout of a fused qkv
    projection's output, so a Llama-style layer, whose q/k/v are such views already, fills them
    in one copy; Qwen3's normed q and k take three), and the output [rows, H, D]. Zeros: the
    output rows of pad tokens must hold finite values from the start."""

    def __init__(self, rows: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.shapes = (q.shape[1:], k.shape[1:], v.shape[1:])
        widths = [q[0].numel(), k[0].numel(), v[0].numel()]
        self.qkv = torch.zeros(rows, sum(widths), dtype=q.dtype, device=q.device)
        q_cols, k_cols, v_cols = self.qkv.split(widths, dim=1)
        self.q = q_cols.view(rows, *q.shape[1:])
        self.k = k_cols.view(rows, *k.shape[1:])
        self.v = v_cols.view(rows, *v.shape[1:])
        self.out = torch.zeros(rows, *q.shape[1:], dtype=q.dtype, device=q.device)

    def check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if (q.shape[1:], k.shape[1:], v.shape[1:]) != self.shapes or not q.dtype == k.dtype == v.dtype == self.qkv.dtype:
            raise RuntimeError(f"attention shapes differ between layers ({tuple(q.shape)}, {tuple(k.shape)}, "
                               f"{tuple(v.shape)} vs {self.shapes}); piecewise CUDA graphs need one shape")

    def fill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Copy this layer's q/k/v in; returns the output rows [:t] for the layer's result."""
        t, width = q.shape[0], self.qkv.shape[1]
        size = q.element_size()
        if (q.stride(0) == k.stride(0) == v.stride(0) == width and q[0].is_contiguous() and k[0].is_contiguous()
                and v[0].is_contiguous() and k.data_ptr() == q.data_ptr() + q[0].numel() * size
                and v.data_ptr() == k.data_ptr() + k[0].numel() * size):
            self.qkv[:t].copy_(q.as_strided((t, width), (width, 1)))  # one view over all three
        else:
            self.q[:t].copy_(q)
            self.k[:t].copy_(k)
            self.v[:t].copy_(v)
        return self.out[:t]


class _Recorder:
    """Installed as the backend's `piecewise` hook for the two forwards of one capture: each
    attention call fills the static q/k/v buffers and returns the static output; when `capturing`,
    it also ends the current piece and begins the next (the copies stay in the ending piece)."""

    def __init__(self, owner: PiecewiseGraphRunner, pool: Any, capturing: bool) -> None:
        self.owner = owner
        self.pool = pool
        self.capturing = capturing
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.sites: list[_Site] = []

    def begin_piece(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode=CAPTURE_ERROR_MODE)
        self.graphs.append(graph)

    def end_piece(self) -> None:
        self.graphs[-1].capture_end()

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, kv_scales: Any, *, window: int = 0,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = self.owner.attention_buffers(q, k, v).fill(q, k, v)  # captured: each replay refills them
        self.sites.append(_Site(kv_cache, scale, kv_scales, window, sinks))
        if self.capturing:
            self.end_piece()
            self.begin_piece()
        return out


class PiecewiseGraphRunner:
    def __init__(self, model: Any, kv_caches: list[torch.Tensor], *, max_num_batched_tokens: int,
                 block_size: int, device: torch.device, sizes: list[int] | None = None) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        backend = getattr(model, "backend", None)
        if backend is None or not getattr(backend, "supports_piecewise_graphs", False):
            raise ValueError(f"the model's attention backend ({getattr(backend, 'name', None)}) cannot be "
                             "split out of a CUDA graph")
        self.backend: Any = backend
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = block_size
        num_blocks = int(kv_caches[0].shape[1])
        top = getattr(model, "piecewise_graph_tokens", MAX_PIECEWISE_TOKENS)
        wanted = sizes if sizes is not None else token_ladder(max_num_batched_tokens, top)
        # Not one token: a one-token forward takes the fused one-token path (attention/fused_decode.py),
        # which has no attention call to cut a graph around; a one-token step pads to the next size.
        self.sizes = sorted(s for s in set(wanted)
                            if s > 1 and min_prefill_blocks(s, _dummy_prompts(s), block_size) <= num_blocks)
        self.max_tokens = self.sizes[-1] if self.sizes else 0
        rows = max(self.max_tokens, 1)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        # Made at the first attention call (its shapes), in the first, eager, forward: never in a graph.
        self._attn: _AttentionBuffers | None = None
        self.pieces: dict[int, _Pieces] = {}
        self.capture_seconds = 0.0

    def attention_buffers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> _AttentionBuffers:
        """The shared static attention buffers (made at the first call)."""
        if self._attn is None:
            self._attn = _AttentionBuffers(self.max_tokens, q, k, v)
        self._attn.check(q, k, v)
        return self._attn

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every ladder size, largest first (the smaller ones reuse its pool memory). No
        attention runs, so the KV cache is not written."""
        with capture_guard():
            return self._capture_all()

    def _capture_all(self) -> float:
        start = time.perf_counter()
        upload = Uploader(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            step = prefill_step(size, _dummy_prompts(size), self.block_size, num_blocks=int(self.kv_caches[0].shape[1]))
            upload.next_step()
            t = upload_step(step.so, upload)
            self.input_ids[:size].copy_(t.input_ids)
            self.positions[:size].copy_(t.positions)
            self.pieces[size] = self._capture_one(size, t.meta, pool)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured piecewise CUDA graphs for steps of up to %d tokens (sizes %s, %d pieces each) in %.1f s",
                    self.max_tokens, self.sizes, len(next(iter(self.pieces.values())).graphs) if self.pieces else 0,
                    self.capture_seconds)
        return self.capture_seconds

    def _capture_one(self, size: int, meta: AttentionMetadata, pool: Any) -> _Pieces:
        args = (self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        self.backend.piecewise = _Recorder(self, pool, capturing=False)
        try:  # warm-up: Triton compiles and cuBLAS picks kernels outside capture
            self.model.forward(*args)
        finally:
            self.backend.piecewise = None
        torch.cuda.synchronize(self.device)
        recorder = _Recorder(self, pool, capturing=True)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        self.backend.piecewise = recorder
        try:
            with torch.cuda.stream(stream):
                recorder.begin_piece()
                try:
                    hidden = self.model.forward(*args)
                finally:
                    recorder.end_piece()
        finally:
            self.backend.piecewise = None
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if len(recorder.graphs) != len(recorder.sites) + 1 or not recorder.sites:
            raise RuntimeError(f"a {size}-token forward captured {len(recorder.graphs)} pieces around "
                               f"{len(recorder.sites)} attention calls")
        return _Pieces(recorder.graphs, recorder.sites, hidden)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return bool(self.pieces) and 0 < meta.num_actual_tokens <= self.max_tokens

    def padded_size(self, tokens: int) -> int:
        return next_captured_size(self.sizes, tokens, "a step's token count")

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [t, hidden] of a step `can_run` accepts: a view of a static tensor, valid
        until the next replay."""
        t = input_ids.shape[0]
        size = self.padded_size(t)
        pieces = self.pieces[size]
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        bufs = self._attn
        assert bufs is not None  # made by the capture
        if size > t:
            self.input_ids[t:size].zero_()
            self.positions[t:size].zero_()
            bufs.out[t:size].zero_()  # pad rows get no attention (module docstring)
        backend = self.backend
        backend.begin_forward(meta)
        for graph, site in zip(pieces.graphs, pieces.sites, strict=False):
            graph.replay()
            backend.forward(bufs.q[:t], bufs.k[:t], bufs.v[:t], site.kv_cache, meta, site.scale, site.kv_scales,
                            out=bufs.out[:t], window=site.window, sinks=site.sinks)
        pieces.graphs[-1].replay()
        return pieces.hidden[:t]
