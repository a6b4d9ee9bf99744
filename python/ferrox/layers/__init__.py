"""Model building blocks: linear (merged projections), rotary, layernorm, activation; the sampler
and logits processors live here too."""
