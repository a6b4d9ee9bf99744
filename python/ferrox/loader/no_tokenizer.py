"""What stands in for the tokenizer under vLLM's skip_tokenizer_init: prompts come as token ids, outputs go
out as token ids (their text empty), and no tokenizer file is read -- the token-in, token-out engine that
reinforcement-learning rollouts drive.

Everything that needs text is refused by name when a request reaches for it: a text prompt, chat
messages, stop strings, bad words, structured outputs (the checks in engine/validation.py and the
engines' prompt paths call `encode`, which raises). The EOS ids come from the model folder's
generation_config.json / config.json instead (worker/model_setup.py).
"""

from __future__ import annotations

from typing import Any

from ferrox.errors import InvalidArgumentError

SKIPPED = ("this engine runs with skip_tokenizer_init: it has no tokenizer, so prompts must be token ids "
           "(prompt_token_ids) and outputs carry no text")


class NoTokenizer:
    """The tokenizer interface the engines read, with no tokenizer behind it."""

    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    special_tokens: dict[str, str] = {}

    def __init__(self, name: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.name = name
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidArgumentError(SKIPPED, param="prompt")

    encode = encode_batch = encode_pairs = decode = get_chat_template = apply_chat_template = _refuse

    @property
    def backend(self) -> Any:
        return self._refuse()

    def token_to_id(self, token: str | None) -> int | None:
        return None

    def id_to_token(self, token_id: int) -> str | None:
        return None

    def to_json_str(self) -> None:
        """No tokenizer.json for the Rust core: it detokenizes nothing and leaves every output's text empty."""
        return None


def no_tokenizer_for(name: str, hf_config: dict[str, Any], vocab_size: int) -> NoTokenizer:
    """The stand-in for a model: config.json's eos_token_id (one id or several) as its EOS ids."""
    eos = hf_config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return NoTokenizer(name, vocab_size, [int(i) for i in ids])
