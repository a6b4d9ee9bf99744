"""Plugin files (vLLM's --tool-parser-plugin, --reasoning-parser-plugin): a Python file a command line names,
run once so that its register calls add names to a registry before the names are checked."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Sequence


def flag_value(argv: Sequence[str], flag: str) -> str | None:
    """The flag's value in a command line (`FLAG PATH` or `FLAG=PATH`), the last one given."""
    found = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def run_plugin_file(path: str, flag: str, prefix: str) -> None:
    """Runs the file once per process (again for the same path: nothing); a missing or failing file is a
    ValueError naming the flag, the file and what went wrong."""
    name = f"{prefix}_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{flag} {path}: not a Python file that can be loaded")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except FileNotFoundError:
        raise ValueError(f"{flag} {path}: no such file") from None
    except Exception as exc:  # noqa: BLE001 - whatever the plugin raises, said with its file
        raise ValueError(f"{flag} {path}: loading it failed: {type(exc).__name__}: {exc}") from None
    sys.modules[name] = module
