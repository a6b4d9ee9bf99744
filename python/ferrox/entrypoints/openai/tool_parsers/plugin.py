"""vLLM's --tool-parser-plugin: a Python file run once at start-up that registers tool parsers, whose names
--tool-call-parser then takes. A ferrox plugin subclasses ferrox's ToolParser (tool_parsers/base.py: `extract`
for a whole reply, `feed` / `finish` for a stream) and registers it:

    from ferrox.entrypoints.openai.tool_parsers import register_tool_parser
    from ferrox.entrypoints.openai.tool_parsers.hermes import HermesToolParser

    @register_tool_parser("my_model")
    class MyModelToolParser(HermesToolParser):
        ...

(A plugin written against vLLM's own classes imports vllm, which ferrox does not ship: it fails to load,
and the error says so.)"""

from __future__ import annotations

from collections.abc import Sequence

from ferrox.plugin_files import flag_value, run_plugin_file

FLAG = "--tool-parser-plugin"


def plugin_path(argv: Sequence[str]) -> str | None:
    """The flag's value in a command line (`--tool-parser-plugin PATH` or `=PATH`), the last one given."""
    return flag_value(argv, FLAG)


def load_tool_parser_plugin(path: str) -> None:
    """Runs the plugin file (its register_tool_parser calls); a missing or failing file is a ValueError
    naming the flag, the file and what went wrong."""
    run_plugin_file(path, FLAG, "ferrox_tool_parser_plugin")
