"""Small Mistral tekken.json files for tests, cut from the real vocabulary mistral_common ships.

mistral_common's package data holds tekken_240911.json (Mistral-Nemo's 131,072-token tekken, 1000 special
ids). A tekken vocabulary is in rank order and every token merges two tokens of lower rank, so its first N
ranks are a tekken of their own: mistral_common cuts a file's vocabulary to default_vocab_size exactly so.
The special tokens are written out (v7+ files must list them): mistral_common's historical first 20, fillers,
then [ARGS], [CALL_ID], [THINK], [/THINK] at their real ids (32..35).
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from typing import Any

NUM_SPECIAL = 40
EXTRA_SPECIALS = ["[ARGS]", "[CALL_ID]", "[THINK]", "[/THINK]"]  # ids 32..35


def real_tekken_path() -> str:
    """The full tekken file inside the installed mistral_common."""
    return str(resources.files("mistral_common") / "data" / "tekken_240911.json")


@functools.lru_cache(maxsize=1)
def _real_tekken() -> dict[str, Any]:
    with open(real_tekken_path(), encoding="utf-8") as f:
        return json.load(f)


def special_tokens() -> list[dict[str, Any]]:
    from mistral_common.tokens.tokenizers.tekken import Tekkenizer

    specials = [{"rank": t["rank"], "token_str": str(t["token_str"]), "is_control": True}
                for t in Tekkenizer.DEPRECATED_SPECIAL_TOKENS]
    specials += [{"rank": i, "token_str": f"<SPECIAL_{i}>", "is_control": True} for i in range(len(specials), 32)]
    specials += [{"rank": 32 + k, "token_str": s, "is_control": True} for k, s in enumerate(EXTRA_SPECIALS)]
    return specials


def write_tekken(folder: str | os.PathLike, *, version: str = "v13", vocab: int = 1000,
                 num_special: int = NUM_SPECIAL, image: dict[str, int] | None = None) -> str:
    """folder/tekken.json: `vocab` regular tokens after `num_special` special ids (n_words = their sum). image:
    the file's image settings (image_patch_size, max_image_size, spatial_merge_size), which mistral_common builds
    its ImageEncoder from ([IMG] 10, [IMG_BREAK] 12, [IMG_END] 13)."""
    real = _real_tekken()
    data = {
        "config": {**real["config"], "version": version, "num_vocab_tokens": vocab,
                   "default_vocab_size": num_special + vocab, "default_num_special_tokens": num_special},
        "vocab": real["vocab"][:vocab],
        "special_tokens": special_tokens(),
    }
    if image is not None:
        data["image"] = dict(image)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tekken.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return path
