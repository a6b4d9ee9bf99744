"""Imports inside the ferrox package point down the layer order, never up or sideways.

Every module under python/ferrox is parsed with `ast` (nothing is imported or executed); every
import statement counts, function-local and `if TYPE_CHECKING:` ones included. Each ferrox module
belongs to one group (longest matching prefix in GROUPS); a module may import its own group and
any group of a lower tier in ORDER. A new top-level module or package must be placed in GROUPS.
Imports built from strings at run time (importlib in models/registry.py and the package root's
lazy `__getattr__`) are not seen here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "python" / "ferrox"

# Group -> module prefixes ("ferrox.kernels" also matches "ferrox.kernels.gemv"; "ferrox", the
# package root, matches only itself).
GROUPS: dict[str, tuple[str, ...]] = {
    # Plain data, shared specs and the exception tree, importable from anywhere. The package root
    # imports only these at run time (LLM, AsyncLLM... load lazily through its __getattr__).
    "base": (
        "ferrox", "ferrox._core", "ferrox.errors", "ferrox.config_fields", "ferrox.model_spec", "ferrox.sampling_params",
        "ferrox.structured.params", "ferrox.config", "ferrox.outputs", "ferrox.step_types", "ferrox.request_rules",
        "ferrox.bad_words", "ferrox.sleep_mode",
        "ferrox.speculative_config", "ferrox.compilation_config", "ferrox.structured_outputs_config",
        "ferrox.kv_events_config", "ferrox.kv_transfer_config", "ferrox.logging_config", "ferrox.prefix_hash_seed", "ferrox.media_io_config",
        "ferrox.pooling.params", "ferrox.pooling.classify", "ferrox.gc_tuning",
        # Beam search's bookkeeping over the engine's outputs (the engines drive it).
        "ferrox.beam_search",
        # The custom logits processor interface users subclass, and its loader (engine and front-end use it).
        "ferrox.logits_processor",
        # Running a plugin file a command line names (tool and reasoning parser plugins).
        "ferrox.plugin_files",
        # Reasoning parsers: text and token ids only (the config names their choices, the engine core
        # and the routes use them).
        "ferrox.reasoning",
    ),
    # Image inputs: fetching and decoding images, pixel values, prompt placeholders, the items the core
    # receives. Only ferrox's errors below it: the front-end, the worker and the models all use it.
    "multimodal": ("ferrox.multimodal",),
    # Tensor-parallel groups and weight sharding: below every layer that shards.
    "distributed": ("ferrox.distributed",),
    "kernels": ("ferrox.kernels",),
    "layers": ("ferrox.layers",),
    "attention": ("ferrox.attention",),
    "models": ("ferrox.models",),
    "loader": ("ferrox.loader",),
    # Multi-LoRA: adapters read from disk, slot buffers, the wrapped projections and their kernels.
    "lora": ("ferrox.lora",),
    # Constrained decoding: the model runner applies its bitmasks (worker -> structured.bitmask),
    # so it sits below the worker rather than beside the engine.
    "structured": ("ferrox.structured",),
    # Pooling models (embeddings): reading a folder's pooling, the poolers; the runner (worker) uses them.
    "pooling": ("ferrox.pooling",),
    "worker": ("ferrox.worker",),
    # Starting and stepping the ranks of a tensor-parallel model (processes, Ray actors).
    "executor": ("ferrox.executor",),
    "engine": ("ferrox.engine",),
    "metrics": ("ferrox.metrics",),
    # `python -m ferrox`: the console script by another door.
    "entrypoints": ("ferrox.entrypoints", "ferrox.__main__"),
}

# Low to high; groups of one tier may not import each other.
ORDER: list[tuple[str, ...]] = [
    ("base",),
    ("multimodal",),
    ("distributed",),
    ("kernels",),
    ("layers", "attention"),
    ("models",),
    ("loader",),
    ("lora",),
    ("structured", "pooling"),
    ("worker",),
    ("executor",),
    # Metrics read the step results (base) and are fed by the front-end (engine/async_llm.py).
    ("metrics",),
    ("engine",),
    ("entrypoints",),
]

# Known exceptions, each (importing module, imported module prefix): why. An entry that no
# import needs any more fails the test, so the list only shrinks.
ALLOWED: dict[tuple[str, str], str] = {
    ("ferrox", "ferrox.engine"): "the package root's TYPE_CHECKING mirror of its lazy public names (LLM, AsyncLLM)",
}

TIER = {group: tier for tier, groups in enumerate(ORDER) for group in groups}


@dataclass(frozen=True, slots=True)
class Import:
    importer: str
    target: str
    path: Path
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _exists(module: str) -> bool:
    """Whether `module` is a module or package of the source tree (or the native _core)."""
    if module == "ferrox._core":
        return True
    rel = Path(*module.split("."))
    base = PACKAGE_DIR.parent / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path) -> list[Import]:
    return _scan(path.read_text(encoding="utf-8"), _module_name(path), path)


def _scan(source: str, importer: str, path: Path) -> list[Import]:
    """The ferrox imports of one module's source, in line order."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "ferrox" or alias.name.startswith("ferrox."):
                    found.append(Import(importer, alias.name, path, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = importer.split(".") if is_package else importer.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base != "ferrox" and not base.startswith("ferrox."):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                # `from pkg import name`: the submodule when one exists, else an attribute of pkg.
                found.append(Import(importer, sub if _exists(sub) else base, path, node.lineno))
    return sorted(found, key=lambda imp: imp.line)


def _group(module: str) -> str | None:
    best, best_len = None, -1
    for group, prefixes in GROUPS.items():
        for prefix in prefixes:
            covers = module == prefix or (prefix != "ferrox" and module.startswith(prefix + "."))
            if covers and len(prefix) > best_len:
                best, best_len = group, len(prefix)
    return best


def _allowed(imp: Import) -> tuple[str, str] | None:
    for importer, prefix in ALLOWED:
        if imp.importer == importer and (imp.target == prefix or imp.target.startswith(prefix + ".")):
            return importer, prefix
    return None


def _all_imports() -> list[Import]:
    files = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(files) > 50, f"found only {len(files)} modules under {PACKAGE_DIR}"
    return [imp for path in files for imp in _imports(path)]


def test_every_module_has_a_layer():
    unplaced = sorted({_module_name(p) for p in PACKAGE_DIR.rglob("*.py") if _group(_module_name(p)) is None})
    assert not unplaced, f"place these modules in a GROUPS entry of {__file__}: {unplaced}"
    assert set(GROUPS) == set(TIER), "every group needs a tier in ORDER, and only once"


def test_imports_point_down():
    problems: dict[str, None] = {}  # ordered, one line per (file, line, target)
    used = set()
    for imp in _all_imports():
        src, dst = _group(imp.importer), _group(imp.target)
        if dst is None:
            problems[f"{imp.path}:{imp.line}: {imp.importer} imports {imp.target}, which no group holds"] = None
            continue
        assert src is not None
        if src == dst or TIER[dst] < TIER[src]:
            continue
        exception = _allowed(imp)
        if exception is not None:
            used.add(exception)
            continue
        direction = "sideways" if TIER[dst] == TIER[src] else "up"
        problems[f"{imp.path.relative_to(PACKAGE_DIR.parents[1])}:{imp.line}: {imp.importer} ({src}) imports "
                 f"{imp.target} ({dst}): points {direction}"] = None
    stale = sorted(set(ALLOWED) - used)
    assert not problems, "imports against the layer order (low to high: " + " < ".join(
        "{" + ", ".join(groups) + "}" for groups in ORDER) + "):\n" + "\n".join(problems)
    assert not stale, f"ALLOWED entries no import needs any more (delete them): {stale}"


def test_scanner_sees_local_relative_and_type_checking_imports():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import linear\n"
        "from .ops import for_device\n"
        "if TYPE_CHECKING:\n"
        "    from ferrox.loader.source import ModelSource\n"
        "def f():\n"
        "    import ferrox.engine.llm\n"
        "    from ferrox import _core, __version__\n"
    )
    found = [(imp.target, imp.line) for imp in _scan(source, "ferrox.layers.probe", PACKAGE_DIR / "layers/probe.py")]
    assert found == [("ferrox.layers.linear", 2), ("ferrox.layers.ops", 3), ("ferrox.loader.source", 5),
                     ("ferrox.engine.llm", 7), ("ferrox._core", 8), ("ferrox", 8)]
    assert [_group(target) for target, _ in found] == ["layers", "layers", "loader", "engine", "base", "base"]
