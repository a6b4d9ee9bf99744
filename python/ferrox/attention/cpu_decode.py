"""The decode path of a quantized GGUF model on the CPU (installed by the model's finalize_weights
once every projection holds CPU-quantized groups): every step, prefill chunks and decodes alike,
run by the Rust kernels (rust/cpu/decoder.rs) in one call.

On two cores a one-token step of the embedded SmolLM2 is ~96 MB of weight reads (~4 ms at the
box's bandwidth) and, through eager torch, ~400 small ops around them that cost more than the
reads. Here every decoder layer -- norm, qkv, rotary, KV write, paged attention, o_proj +
residual, norm, gate_up, SiLU, down_proj + residual -- runs inside one call on the kernel threads,
reading the 4/8-bit groups the layers already hold (layers/quant/cpu_weight.py). The model then
applies its final norm and LM head (the same kernels, one row). A layer's sliding window (Phi-3's files
carry one) goes to the Rust layer, whose attention then starts each token at its window.

The path takes every step with a float32 KV cache, prefill chunks included: each token's
arithmetic is then one code path whatever the batch, so a request's output is the same alone,
batched, chunked or after a prefix-cache hit (the model's own layers would round differently). Float or FP8 weights, LoRA (which puts the
general path back), the profiling forward without a cache and FERROX_FUSED_DECODE=0 run through
the model's layers. The Rust layers are built at the first step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ferrox import _core
from ferrox.attention.decode_path import DecodePath, OneTokenLayer, fused_decode_enabled
from ferrox.attention.metadata import AttentionMetadata


def _floats(t: torch.Tensor | None):
    return None if t is None else t.detach().to(torch.float32).contiguous().numpy()


def _matrix(proj) -> _core.CpuQuantMatrix | None:
    """The Rust matrix of a CPU-quantized projection (CpuQuantWeight.matrix), else None."""
    return getattr(getattr(proj, "quant", None), "matrix", None)


class CpuQuantizedDecode(DecodePath):
    name = "cpu-quantized"

    def __init__(self, layers: Sequence[OneTokenLayer] | None, rope_rows: Callable[[torch.Tensor], torch.Tensor]):
        self.layers = tuple(layers) if layers is not None else None
        self.rope_rows = rope_rows
        self._decoder: _core.CpuDecoder | None = None
        self.rust_layers: list[_core.CpuDecoderLayer] = []  # what the decoder runs (tests run them one by one)
        self._usable: bool | None = None  # decided at the first step

    def _build(self) -> bool:
        assert self.layers is not None
        built = []
        for layer in self.layers:
            projs = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            found = [_matrix(p) for p in projs]
            mats = [m for m in found if m is not None]
            if len(mats) != len(projs) or (layer.tp is not None and layer.tp.size > 1):
                return False
            qkv, o, gate_up, down = mats
            assert layer.gate_up_proj is not None and layer.down_proj is not None  # _matrix found them
            built.append(_core.CpuDecoderLayer(
                input_norm=_floats(layer.input_norm.weight), post_norm=_floats(layer.post_norm.weight),
                eps=float(layer.input_norm.eps), qkv=qkv, o=o, gate_up=gate_up, down=down,
                num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim,
                scale=float(layer.scale), qkv_bias=_floats(layer.qkv_proj.bias), o_bias=_floats(layer.o_proj.bias),
                gate_up_bias=_floats(layer.gate_up_proj.bias), down_bias=_floats(layer.down_proj.bias),
                window=layer.window))
        self.rust_layers = built
        self._decoder = _core.CpuDecoder(built)
        return True

    def takes_step(self, num_tokens: int, kv_caches: Sequence[torch.Tensor],
                   meta: AttentionMetadata | None = None) -> bool:
        if self.layers is None or meta is None or not fused_decode_enabled():
            return False
        if num_tokens != meta.num_actual_tokens:
            return False  # padded rows: not a layout this path reads
        if not kv_caches or kv_caches[0].numel() == 0 or kv_caches[0].dtype != torch.float32:
            return False
        if self._usable is None:
            self._usable = self._build()
        return self._usable

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        assert self._decoder is not None, "takes_step builds the decoder"
        h = h.to(torch.float32).contiguous()
        n = meta.num_actual_tokens
        # numpy views of the caches (shared memory), made per step (~1 us a layer): a view kept would keep a
        # cache's storage alive after sleep mode drops it (worker/sleep_memory.py).
        self._decoder.forward(h.numpy(), [c.numpy() for c in kv_caches], self.rope_rows(positions).contiguous().numpy(),
                              meta.slot_mapping[:n].contiguous().numpy(), meta.query_start_loc.contiguous().numpy(),
                              meta.block_table.contiguous().numpy(), meta.seq_lens.contiguous().numpy())
        return h
