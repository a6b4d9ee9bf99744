"""Prompts shared by the engine tests (varied lengths and kinds)."""

from __future__ import annotations

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "In a shocking finding, scientists discovered a herd of unicorns living in a remote, previously unexplored "
    "valley in the Andes Mountains. Even more surprising to the researchers was the fact that",
    "def fibonacci(n):",
    "Q: What is the boiling point of water in Celsius?\nA:",
    "The three primary colors are",
    "Once upon a time",
    "Translate to French: I like apples.",
    "A list of fruits: apple, banana,",
    "The quick brown fox",
    "Python is a programming language that",
    "My favourite season is autumn because",
    "Summarize: The meeting was moved from Monday to Wednesday because the room was booked.",
    "import numpy as np\n",
]


def greedy_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]
