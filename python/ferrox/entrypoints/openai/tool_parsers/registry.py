"""Tool parsers by name (the server's --tool-call-parser), with a default from the chat template."""

from __future__ import annotations

from ferrox.entrypoints.openai.tool_parsers.base import ToolParser
from ferrox.entrypoints.openai.tool_parsers.deepseek_v3 import CALLS_BEGIN as DEEPSEEK_CALLS
from ferrox.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from ferrox.entrypoints.openai.tool_parsers.functiongemma import CALL_BEGIN as FUNCTIONGEMMA_CALL
from ferrox.entrypoints.openai.tool_parsers.functiongemma import FunctionGemmaToolParser
from ferrox.entrypoints.openai.tool_parsers.gemma4 import CALL_BEGIN as GEMMA4_CALL
from ferrox.entrypoints.openai.tool_parsers.gemma4 import Gemma4ToolParser
from ferrox.entrypoints.openai.tool_parsers.glm45 import KEY_BEGIN as GLM_ARG_KEY
from ferrox.entrypoints.openai.tool_parsers.glm45 import KEY_END as GLM_ARG_KEY_END
from ferrox.entrypoints.openai.tool_parsers.glm45 import VALUE_BEGIN as GLM_ARG_VALUE
from ferrox.entrypoints.openai.tool_parsers.glm45 import Glm45ToolParser
from ferrox.entrypoints.openai.tool_parsers.glm47 import Glm47ToolParser
from ferrox.entrypoints.openai.tool_parsers.granite import GraniteToolParser
from ferrox.entrypoints.openai.tool_parsers.granite_20b_fc import Granite20bFCToolParser
from ferrox.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from ferrox.entrypoints.openai.tool_parsers.kimi_k2 import SECTION_BEGIN as KIMI_SECTION
from ferrox.entrypoints.openai.tool_parsers.kimi_k2 import KimiK2ToolParser
from ferrox.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from ferrox.entrypoints.openai.tool_parsers.minimax_m2 import BLOCK_BEGIN as MINIMAX_BLOCK
from ferrox.entrypoints.openai.tool_parsers.minimax_m2 import MinimaxM2ToolParser
from ferrox.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from ferrox.entrypoints.openai.tool_parsers.openai_harmony import OpenAIHarmonyToolParser
from ferrox.entrypoints.openai.tool_parsers.phi4_mini import Phi4MiniJsonToolParser
from ferrox.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from ferrox.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from ferrox.entrypoints.openai.tool_parsers.seed_oss import TOOL_CALL as SEED_TOOL_CALL
from ferrox.entrypoints.openai.tool_parsers.seed_oss import SeedOssToolParser
from ferrox.entrypoints.openai.tool_parsers.xlam import XLamToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "qwen2_5": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,  # vLLM's second parser of Qwen3-Coder's format (an XML-event reader)
    "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser,
    "granite": GraniteToolParser,
    "granite-20b-fc": Granite20bFCToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser,
    "xlam": XLamToolParser,
    "openai": OpenAIHarmonyToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "deepseek_v31": DeepSeekV31ToolParser,
    "kimi_k2": KimiK2ToolParser,
    "glm45": Glm45ToolParser,
    "glm47": Glm47ToolParser,
    "seed_oss": SeedOssToolParser,
    "minimax_m2": MinimaxM2ToolParser,
    "functiongemma": FunctionGemmaToolParser,
    "gemma4": Gemma4ToolParser,
}


def register_tool_parser(*names: str):  # type: ignore[no-untyped-def]
    """Class decorator of a --tool-parser-plugin file (tool_parsers/plugin.py): the ToolParser subclass becomes
    --tool-call-parser NAME for each name (a built-in name is replaced, as vLLM's plugins may)."""
    if not names:
        raise ValueError("register_tool_parser: give the parser at least one name")

    def register(cls: type[ToolParser]) -> type[ToolParser]:
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise TypeError(f"register_tool_parser: {cls!r} is not a ToolParser subclass")
        for name in names:
            TOOL_PARSERS[name] = cls
        return cls

    return register


def get_tool_parser(name: str) -> type[ToolParser]:
    parser = TOOL_PARSERS.get(name)
    if parser is None:
        raise ValueError(
            f"tool_call_parser: unknown parser {name!r} (known: {', '.join(sorted(TOOL_PARSERS))})"
        )
    return parser


def default_tool_parser(chat_template: str | None) -> str:
    """From what the chat template teaches the model: Mistral's templates write [TOOL_CALLS],
    Qwen3-Coder's <function=...><parameter=...> (Seed-OSS's, between <seed:tool_call> markers: `seed_oss`),
    Llama 3's mention <|python_tag|> / ipython, Granite
    3.x's write <|tool_call|> before the list of calls (Granite 4's Hermes-style <tool_call>...
    </tool_call> stays Hermes), vLLM's Phi-4-mini template asks for `functools[...]` and
    granite-20b-functioncalling's lists the tools after <|function_call_library|>, gpt-oss's write
    harmony's <|channel|> (calls are messages `to=functions.NAME`: the `openai` parser); DeepSeek's write
    <｜tool▁calls▁begin｜>, with the arguments in a ```json block up to V3-0324 / R1-0528 (`deepseek_v3`)
    and bare from V3.1 on (`deepseek_v31`), Kimi-K2's <|tool_calls_section_begin|>, GLM-4.5's
    <arg_key> pairs (`glm45`), or GLM-4.7's, whose template writes a pair without the newline between
    `</arg_key>` and `<arg_value>` that GLM-4.5 / 4.6's write (`glm47`), MiniMax-M2's <minimax:tool_call>
    (`minimax_m2`), FunctionGemma's <start_function_call> (`functiongemma`), Gemma 4's `<|tool_call>call:`
    (`gemma4`); everything else gets Hermes, which
    is also what ferrox's own tool prompt (structured/tools.py) asks for."""
    if not chat_template:
        return "hermes"
    if DEEPSEEK_CALLS in chat_template:
        return "deepseek_v3" if "```json" in chat_template else "deepseek_v31"
    if KIMI_SECTION in chat_template:
        return "kimi_k2"
    if MINIMAX_BLOCK in chat_template:
        return "minimax_m2"
    if FUNCTIONGEMMA_CALL in chat_template:
        return "functiongemma"
    if GEMMA4_CALL + "call:" in chat_template:
        return "gemma4"
    if GLM_ARG_KEY in chat_template and "<tool_call>" in chat_template:
        return "glm47" if GLM_ARG_KEY_END + GLM_ARG_VALUE in chat_template else "glm45"
    if SEED_TOOL_CALL in chat_template:  # (before qwen3_coder's test: the calls inside are its format)
        return "seed_oss"
    if "<|channel|>" in chat_template:
        return "openai"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<function=" in chat_template and "<parameter=" in chat_template:
        return "qwen3_coder"
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return "llama3_json"
    if "<|tool_call|>" in chat_template and "</tool_call>" not in chat_template:
        return "granite"
    if "functools" in chat_template:
        return "phi4_mini_json"
    if "<|function_call_library|>" in chat_template:
        return "granite-20b-fc"
    return "hermes"
