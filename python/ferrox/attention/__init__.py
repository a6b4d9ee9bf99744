"""Attention: the per-step metadata (metadata.py), the backend interface (backend.py), the torch
reference backend (torch_backend.py), the Triton one (triton_backend.py), KV cache allocation
(kv_cache.py), and the decode path a backend gives a model (decode_path.py: the general one;
fused_decode.py: the Triton backend's one-token kernels)."""
