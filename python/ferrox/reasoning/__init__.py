"""Reasoning models' thinking, told apart from their answer (vLLM's --reasoning-parser).

Models such as DeepSeek-R1 and Qwen3 write a chain of thought between `<think>` and `</think>`
before the answer. With a reasoning parser the server returns the two apart (`reasoning` next to
`content`), parses tool calls from the answer only, and a structured-output constraint applies
from the end of the thinking on (the engine core's grammar gate). DeepSeek-V3.1, GLM-4.5 / 4.7, Kimi-K2
(whose tool-call section may end the thinking), Magistral (`[THINK]`) and Granite (text markers) are marker
families of the same parser (families.py);
gpt-oss's harmony channels have their own (`openai_gptoss`: harmony.py).
"""

from ferrox.reasoning.parser import (
    REASONING_PARSERS,
    AnyReasoningParser,
    AnyReasoningStream,
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)

__all__ = ["REASONING_PARSERS", "AnyReasoningParser", "AnyReasoningStream", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]
