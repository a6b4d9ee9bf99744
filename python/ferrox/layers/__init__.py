"""Model building blocks: linear (merged projections), rotary, layernorm, activation, and ops.py,
which picks each op's torch or Triton implementation once, when a model is built; the sampler and
logits processors live here too."""
