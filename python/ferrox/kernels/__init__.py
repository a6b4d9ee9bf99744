"""GPU kernels. Each has a plain-torch reference and a test against it (tests/kernels/), run on CPU
under the Triton interpreter at tiny shapes and on the GPU at Llama-3.1-8B shapes.

- reshape_and_cache.py  K/V write into the paged cache through the slot mapping (slot -1 skipped)
- paged_attention.py    unified paged attention for mixed prefill-chunk + decode batches (GQA,
                        causal chunks, any block size) with a split-KV path for long contexts
- rmsnorm.py            RMSNorm, fused with the residual add
- activation.py         SiLU-and-mul of the gated MLP
- rotary.py             neox rotary embedding from a cos/sin cache (+ Llama 3.1 frequency scaling)
- gemv.py               one-token matrix-vector products with RMSNorm / residual / SiLU / rotary +
                        KV write fused in (batch-1 decode: five launches per decoder layer)
- cuda_sampling.py      top-k/top-p sampling: CUDA C++ kernel (cuda/) JIT-built once (on a
                        background thread at a first engine start, used from the next start on),
                        torch fallback otherwise and off CUDA
- exponential_race.py   the sampler's draw for plain temperature sampling in one pass

Modules import triton at import time (cuda_sampling.py does not); import them only where a GPU path may run.
Measured numbers: benches/RESULTS.md (benches/bench_kernels.py).
"""
