"""Attention: the per-step metadata (metadata.py), the backend interface (backend.py), the torch
reference backend (torch_backend.py), the Triton one (triton_backend.py), KV cache allocation
(kv_cache.py)."""
