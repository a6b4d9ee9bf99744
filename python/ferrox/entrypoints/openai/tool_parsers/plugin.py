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

import importlib.util
import sys
from collections.abc import Sequence

FLAG = "--tool-parser-plugin"


def plugin_path(argv: Sequence[str]) -> str | None:
    """The flag's value in a command line (`--tool-parser-plugin PATH` or `=PATH`), the last one given."""
    found = None
    for i, arg in enumerate(argv):
        if arg == FLAG and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(FLAG + "="):
            found = arg.split("=", 1)[1]
    return found


def load_tool_parser_plugin(path: str) -> None:
    """Runs the plugin file (its register_tool_parser calls); a missing or failing file is a ValueError
    naming the flag, the file and what went wrong."""
    spec = importlib.util.spec_from_file_location(f"ferrox_tool_parser_plugin_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{FLAG} {path}: not a Python file that can be loaded")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except FileNotFoundError:
        raise ValueError(f"{FLAG} {path}: no such file") from None
    except Exception as exc:  # noqa: BLE001 - whatever the plugin raises, said with its file
        raise ValueError(f"{FLAG} {path}: loading it failed: {type(exc).__name__}: {exc}") from None
    sys.modules[spec.name] = module
