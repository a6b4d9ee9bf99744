"""Layers a checkpoint leaves unquantized, named in its exclude list, matched against the built model's
modules; the linear layers they name go back to a float weight before any tensor loads.

A linear layer takes its weight method when it is built, before it has a name (layers/quant/method.py);
`keep_excluded_in_float` runs once the whole model exists (QuantConfig.keep_unquantized, called by
loader/model_loader.py) and gives each named layer a float `weight` of the model dtype in place of its method.

An entry names a module by its checkpoint name (e.g. `model.layers.3.mlp.down_proj`). Each layout writes
its list in its own syntax, read as vLLM reads it:

- "modelopt" -- ModelOpt's `exclude_modules` (config.json `ignore`), vLLM's modelopt.py `is_layer_excluded`:
  with wildcards (`*`, `?`, `[`), a shell pattern over the whole name (`model.layers.*.mlp.gate`); a trailing
  `*` right after a name, ModelOpt's `module_path*` for "this module and everything under it", means that
  subtree: `model.layers.1*` names layer 1, not layers 10-19 (vLLM rewrites the pattern so for remapped
  models; a plain shell match would take both). Without wildcards, as "substring" below.
- "substring" -- the fp8 layout's `ignored_layers` / `modules_to_not_convert` (and ModelOpt's plain entries),
  vLLM's `is_layer_skipped` with `skip_with_substr` (its rule for `modules_to_not_convert`; the exact names
  its Fp8Config also matches are a special case): the entry found in the name, that module or any under it
  (`lm_head`, `model.layers.3.mlp`, `down_proj`, `self_attn`) -- kept to whole dotted components, so that
  `mlp.gate` (a router) does not name `mlp.gate_up_proj`'s gate shard and `layers.1` not `layers.10` (a bare
  substring would, and then refuse the merged layer it half names).
- "compressed-tensors" -- llm-compressor's `ignore`, vLLM's compressed_tensors/utils.py `should_ignore_layer`:
  the exact module name, or `re:` and a Python regex matched from the start of the name (`re:.*mlp.gate$`,
  `re:model.layers.0.*`), no parent or suffix matching. "Linear" (a module class, compressed-tensors' name for
  every linear layer) would leave nothing quantized and is refused.

A merged layer (q/k/v, gate/up) answers to its own name and to its shards' checkpoint names beside it
(`q_proj`, `k_proj`, `v_proj`, `gate_proj`, `up_proj`): it stays float when its name or every shard's is
named; some shards but not all is refused (one layer runs one matmul in one dtype), as vLLM refuses it.
A mixture-of-experts layer an entry reaches is refused by name: its FP8 experts are chosen when it is
built, and the expert layer has no way back to float yet.

A model whose module names are not its checkpoint's (Nemotron-H's `backbone.layers.N` read as `model.layers.N`)
says how the checkpoint spells a module (`checkpoint_module_name(name)`); an entry then names a module in either
spelling, as vLLM maps a ModelOpt exclude list through the model's name mapper.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrox.model_spec import UnsupportedModelError

if TYPE_CHECKING:
    from ferrox.layers.linear import Linear

logger = logging.getLogger(__name__)

_WILDCARDS = ("*", "?", "[")
# The routed experts' checkpoint projections (Qwen / DeepSeek names, and Mixtral's).
_EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
SYNTAXES = ("modelopt", "substring", "compressed-tensors")


def _component_regex(entry: str) -> str:
    """The regex (matched from the start, anchored at the end) of the names holding `entry` as whole dotted
    components: that module and any under it."""
    return rf"(?s:(?:.*\.)?{re.escape(entry)}(?:\..*)?)\Z"


def _modelopt_regex(entry: str) -> str:
    if any(c in entry for c in _WILDCARDS):
        if len(entry) > 1 and entry.endswith("*") and entry[-2] not in ".*":
            base = fnmatch.translate(entry[:-1])  # (?s:...)\Z
            return f"(?:{base}|{fnmatch.translate(entry[:-1] + '.*')})"
        return f"(?:{fnmatch.translate(entry)})"
    return _component_regex(entry)


def _matchers(entries: tuple[str, ...], syntax: str, where: str) -> tuple[frozenset[str], list[re.Pattern[str]]]:
    """(exact names, regexes each matched from the start of a name) of `entries` in `syntax` (module docstring)."""
    if syntax in ("modelopt", "substring"):
        # One alternation for all entries (regexes built here): a model's names are checked against it once each.
        build = _modelopt_regex if syntax == "modelopt" else _component_regex
        return frozenset(), [re.compile("|".join(build(e) for e in entries))] if entries else []
    if syntax != "compressed-tensors":
        raise ValueError(f"syntax must be one of {', '.join(SYNTAXES)}, got {syntax!r}")
    if "Linear" in entries:
        raise UnsupportedModelError(f"{where}: 'Linear' names every linear layer (a module class, as compressed-tensors "
                                    "reads it), which leaves no layer quantized; vLLM matches ignore entries against "
                                    "module names only")
    patterns = []
    for entry in entries:
        if entry.startswith("re:"):
            try:  # (each apart: a checkpoint's regex may hold groups or flags an alternation would break)
                patterns.append(re.compile(entry[3:]))
            except re.error as e:
                raise UnsupportedModelError(f"{where}: {entry!r} is not a regular expression ({e})") from None
    return frozenset(e for e in entries if not e.startswith("re:")), patterns


class ExcludeList:
    """The entries of one checkpoint's exclude list in one of SYNTAXES (`where`: the config field, for messages)."""

    def __init__(self, entries: Iterable[str], where: str, syntax: str = "modelopt",
                 checkpoint_name: Callable[[str], str] | None = None):
        """checkpoint_name: the checkpoint's spelling of a model module name (module docstring), None when the
        two agree."""
        self.entries = tuple(entries)
        self.where = where
        self.syntax = syntax
        self.checkpoint_name = checkpoint_name
        self._exact, self._patterns = _matchers(self.entries, syntax, where)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def read_as(self, checkpoint_name: Callable[[str], str]) -> ExcludeList:
        """This list matched against a model that spells its modules otherwise than its checkpoint."""
        return ExcludeList(self.entries, self.where, self.syntax, checkpoint_name)

    def _spellings(self, name: str) -> tuple[str, ...]:
        return (name,) if self.checkpoint_name is None else (name, self.checkpoint_name(name))

    def _matches(self, name: str) -> bool:
        return name in self._exact or any(p.match(name) is not None for p in self._patterns)

    def names(self, name: str) -> bool:
        """Whether some entry names module `name` (in the model's or the checkpoint's spelling)."""
        return any(self._matches(n) for n in self._spellings(name))

    def entry_for(self, name: str) -> str:
        """The first entry that names `name` (for messages)."""
        return next(e for e in self.entries if ExcludeList([e], self.where, self.syntax, self.checkpoint_name).names(name))


def _shard_names(name: str, layer: nn.Module) -> list[str]:
    """A merged layer's shards as the checkpoint names them beside it (llama's `q_proj` for shard "q"); []
    for a plain layer."""
    shards = getattr(layer, "shard_sizes", None)
    if not shards:
        return []
    parent = name.rpartition(".")[0]
    return [f"{parent}.{shard}_proj" for shard in shards]


def _excluded(excluded: ExcludeList, name: str, layer: nn.Module) -> bool:
    """Whether linear layer `name` stays float (module docstring); partly named merged layers refused."""
    if excluded.names(name):
        return True
    shards = _shard_names(name, layer)
    named = [s for s in shards if excluded.names(s)]
    if named and len(named) != len(shards):
        raise UnsupportedModelError(
            f"{excluded.where}: {excluded.entry_for(named[0])!r} leaves {', '.join(named)} unquantized but not "
            f"{', '.join(s for s in shards if s not in named)}, which ferrox runs as one layer ({name}): all shards "
            "of a merged projection must have the same precision")
    return bool(named)


def _experts_named(excluded: ExcludeList, name: str, num_experts: int) -> str | None:
    """The first checkpoint name of mixture-of-experts layer `name` (`...mlp.experts`) an entry reaches."""
    candidates = [name, name.replace(".mlp.", ".block_sparse_moe.")]
    for prefix in dict.fromkeys(candidates):
        for e in range(num_experts):
            candidates += [f"{prefix}.{e}.{proj}" for proj in _EXPERT_PROJECTIONS]
    return next((c for c in candidates if excluded.names(c)), None)


def _to_float(layer: Linear) -> None:
    """A linear layer built with a checkpoint method, given a float weight of the model dtype instead (the
    method's empty placeholder `weight` has that dtype and device)."""
    placeholder = layer.weight
    layer.weight_method = None
    layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=placeholder.dtype,
                                            device=placeholder.device), requires_grad=False)


def keep_excluded_in_float(model: nn.Module, excluded: ExcludeList) -> list[str]:
    """Give every quantized linear layer of `model` that `excluded` names a float weight (module docstring);
    refuse named mixture-of-experts layers. Returns the names of the layers made float."""
    from ferrox.layers.fused_moe import FusedMoE
    from ferrox.layers.linear import Linear

    kept: list[str] = []
    if not excluded:
        return kept
    checkpoint_name = getattr(model, "checkpoint_module_name", None)
    if checkpoint_name is not None:
        excluded = excluded.read_as(checkpoint_name)
    for name, module in model.named_modules():
        if getattr(module, "weight_method", None) is None:
            continue  # float already (a router, a vision tower, a layer built float on purpose)
        if isinstance(module, FusedMoE):
            hit = _experts_named(excluded, name, module.num_experts)
            if hit is not None:
                raise UnsupportedModelError(
                    f"{excluded.where}: {excluded.entry_for(hit)!r} leaves the experts {hit} unquantized; ferrox "
                    "loads a mixture-of-experts layer's experts quantized or not at all (float experts in a quantized "
                    "checkpoint are not supported)")
        elif isinstance(module, Linear) and _excluded(excluded, name, module):
            _to_float(module)
            kept.append(name)
    if kept:
        logger.info("%s: %d linear layer(s) kept in the model dtype (%s%s)", excluded.where, len(kept),
                    ", ".join(kept[:4]), ", ..." if len(kept) > 4 else "")
    return kept
