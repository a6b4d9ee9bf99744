"""Scoring with an embedding (bi-encoder) model, as vLLM's score and rerank APIs do for one: each text is
embedded on its own and a pair's score is the cosine similarity of its two vectors. (A cross-encoder reads
each pair as one sequence instead: loader/tokenizer.py encode_pairs, models/bert_classifier.py; it shares
the pairing rules.)

The two sides pair up 1:N (one first text against every second text) or N:N (pairwise); one side empty,
or N:M with N > 1 and N != M, is refused naming the first side's field. LLM.score and the /score and
/rerank routes share these rules; each distinct text is embedded once per call (`distinct`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import numpy.typing as npt

from ferrox.errors import InvalidArgumentError

# torch.nn.CosineSimilarity's default floor on each norm (vLLM scores with it): a zero vector scores 0.
_EPS = 1e-8


def score_pairs(n_1: int, n_2: int, names: tuple[str, str] = ("data_1", "data_2")) -> list[tuple[int, int]]:
    """The (first, second) index of every scored pair, in output order."""
    first, second = names
    if n_1 == 0:
        raise InvalidArgumentError(f"{first}: at least one text must be given", param=first)
    if n_2 == 0:
        raise InvalidArgumentError(f"{second}: at least one text must be given", param=second)
    if n_1 == 1:
        return [(0, j) for j in range(n_2)]
    if n_1 != n_2:
        raise InvalidArgumentError(
            f"{first}: {n_1} texts against {n_2} in {second}; give one {first} (scored against every {second}) or "
            f"as many as {second} (scored pairwise)", param=first)
    return [(i, i) for i in range(n_1)]


def pair_labels(n_1: int, n_2: int, i: int, j: int, names: tuple[str, str] = ("data_1", "data_2")) -> str:
    """How errors name a cross-encoder's pair prompt (the two texts read as one sequence)."""
    first = f"{names[0]}[{i}]" if n_1 > 1 else names[0]
    second = f"{names[1]}[{j}]" if n_2 > 1 else names[1]
    return f"the pair {first} + {second}"


def distinct(keys: Sequence[Hashable]) -> tuple[list[int], list[int]]:
    """(the position of each distinct key's first occurrence, each key's index among the distinct ones):
    what to embed, and where each input's vector is."""
    first: list[int] = []
    index_of: dict[Hashable, int] = {}
    where: list[int] = []
    for i, key in enumerate(keys):
        if key not in index_of:
            index_of[key] = len(first)
            first.append(i)
        where.append(index_of[key])
    return first, where


def cosine_similarity(a: npt.NDArray[np.float32], b: npt.NDArray[np.float32]) -> float:
    """a.b / (|a| |b|), in float64 (equal to the dot product of the two normalised vectors)."""
    x, y = a.astype(np.float64), b.astype(np.float64)
    return float(np.dot(x, y) / (max(float(np.linalg.norm(x)), _EPS) * max(float(np.linalg.norm(y)), _EPS)))
