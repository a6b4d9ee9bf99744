"""vLLM's --reasoning-parser-plugin: a Python file run at start-up -- in the API server and in every engine
core, which both read a request's thinking -- that registers reasoning parsers, whose names
--reasoning-parser then takes. ferrox's parsers are marker families (families.py): the tags that open and
close the thinking, what output without an opening tag is, the chat-template switch, and whether the tags are
single tokens (then the engine's grammar gate, thinking budget and reasoning-token count work too). A plugin:

    from ferrox.reasoning.families import Family
    from ferrox.reasoning.plugin import register_reasoning_parser

    register_reasoning_parser("seed_oss", Family(("<seed:think>",), ("</seed:think>",), untagged="reasoning"))

(A plugin written against vLLM's ReasoningParser classes imports vllm, which ferrox does not ship: it fails to
load, and the error says so.)"""

from __future__ import annotations

from ferrox.plugin_files import run_plugin_file
from ferrox.reasoning.families import FAMILIES, Family
from ferrox.reasoning.harmony import NAME as HARMONY_NAME

FLAG = "--reasoning-parser-plugin"
BUILT_IN = (*FAMILIES, HARMONY_NAME)


def register_reasoning_parser(name: str, family: Family) -> None:
    """Adds a marker family under `name` (a plugin's call; ValueError for a built-in name or a bad family)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_reasoning_parser: the name must be a non-empty string, got {name!r}")
    if name in BUILT_IN:
        raise ValueError(f"register_reasoning_parser: {name!r} is one of ferrox's own parsers")
    if not isinstance(family, Family):
        raise ValueError(f"register_reasoning_parser({name!r}): give a ferrox.reasoning.families.Family, got "
                         f"{type(family).__name__}")
    if not family.start_tags or not family.end_tags or family.untagged not in ("reasoning", "content", "scan"):
        raise ValueError(f"register_reasoning_parser({name!r}): a family needs start and end tags and untagged "
                         "'reasoning', 'content' or 'scan'")
    FAMILIES[name] = family


def load_reasoning_parser_plugin(path: str | None) -> None:
    """Runs the plugin file once in this process (None: nothing); a missing or failing file is a ValueError
    naming the flag and the file."""
    if path:
        run_plugin_file(path, FLAG, "ferrox_reasoning_parser_plugin")
