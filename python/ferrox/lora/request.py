"""LoRARequest: which adapter a request runs with, spelled as vLLM spells it.

`LoRARequest(lora_name, lora_int_id, lora_path)` positionally, like vLLM; `lora_int_id` is the
adapter's identity everywhere in ferrox (scheduler, slots, caches) and 0 is reserved for "no
adapter", so ids start at 1. vLLM's newer property names (`name`, `adapter_id`, `path`) read the
same fields.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from ferrox.errors import InvalidArgumentError


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidArgumentError(f"lora_name: must be a non-empty string, got {self.lora_name!r}",
                                       param="lora_name")
        # bool is an int subclass; True as an id is a caller's mistake, not adapter 1.
        try:
            lora_int_id = None if isinstance(self.lora_int_id, bool) else operator.index(self.lora_int_id)
        except TypeError:
            lora_int_id = None
        if lora_int_id is None or lora_int_id < 1:
            raise InvalidArgumentError(f"lora_int_id: must be an integer >= 1 (0 means no adapter), got "
                                       f"{self.lora_int_id!r}", param="lora_int_id")
        object.__setattr__(self, "lora_int_id", lora_int_id)  # numpy integers become plain ints (hashing)
        if not isinstance(self.lora_path, str):
            raise InvalidArgumentError(f"lora_path: must be a string, got {type(self.lora_path).__name__}",
                                       param="lora_path")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
