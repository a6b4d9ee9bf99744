"""Triton attention backend (CUDA): the KV write and one unified paged-attention launch per layer.

Same contract as the torch reference (attention/backend.py): write this step's k/v at
`meta.slot_mapping`, then attend every request of the mixed batch (prefill chunks and decodes
together, GQA, causal within a chunk) over its paged KV. Two kernel launches per layer, plus a
split-KV merge when the heuristic splits long contexts; nothing reads device memory on the host,
so a decode step can be captured in a CUDA graph (the runner passes max_seq_len as a fixed upper
bound and pads slot_mapping with -1). Its decode path runs one-token steps in fused
matrix-vector kernels (attention/fused_decode.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ferrox.attention.backend import AttentionBackend
from ferrox.attention.decode_path import DecodePath, OneTokenLayer
from ferrox.attention.fused_decode import FusedOneTokenDecode
from ferrox.attention.metadata import AttentionMetadata
from ferrox.kernels.paged_attention import unified_attention
from ferrox.kernels.reshape_and_cache import reshape_and_cache


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cached_kv = True

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if kv_cache.numel() == 0:
            return self._forward_without_cache(q, k, v, meta, scale)
        if meta.slot_mapping.shape[0] > k.shape[0]:
            raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} slots for {k.shape[0]} k/v rows")
        reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale)

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return unified_attention(
            q,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            scale=scale,
        )

    def decode_path(self, layers: Sequence[OneTokenLayer] | None,
                    rope_rows: Callable[[torch.Tensor], torch.Tensor]) -> DecodePath:
        """One-token steps in fused matrix-vector kernels (attention/fused_decode.py)."""
        return FusedOneTokenDecode(self, layers, rope_rows)

    def _forward_without_cache(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """No KV cache yet (the profiling forward): every request starts at position 0, so its KV is
        exactly its own k/v rows. View them as a cache of one-slot blocks, block id = token row, and
        run the same kernel, so profiling measures the memory the real path uses."""
        kv = torch.stack((k, v)).unsqueeze(2)  # [2, T, block_size=1, Hkv, D]
        query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
        rows = torch.arange(max(meta.max_query_len, 1), dtype=torch.int32, device=q.device)
        block_table = (meta.query_start_loc[:-1, None] + rows[None, :]).to(torch.int32)
        return unified_attention(
            q,
            kv,
            meta.query_start_loc,
            query_lens.to(torch.int32),
            block_table,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_query_len,
            scale=scale,
        )
