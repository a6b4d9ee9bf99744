"""Pooling models (embeddings): the pooling settings of a model folder and of a request, and the
poolers that turn a prompt's hidden states into one vector.

    params.py  PoolingParams (per request), PoolerConfig (per model), their request rules (base layer)
    config.py  the runner ("generate" | "pooling") and the PoolerConfig a model folder declares
    pooler.py  mean / CLS / last-token pooling, normalisation, Matryoshka truncation
    tokens.py  encoding prompts for a pooling model (the folder's tokenizer.json, as transformers does)

Nothing is imported here: `ferrox.pooling.params` stays importable without torch.
"""
