"""LoRA adapters as the API sees them: names clients put in the `model` field.

- `ferrox serve --enable-lora --lora-modules name=path ...` registers adapters at start-up; each is
  loaded on every engine core before the server reports ready, so a bad one stops the start.
- `/v1/models` lists each adapter (parent: the base model; root: its folder), as vLLM does.
- `POST /v1/load_lora_adapter` {"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter`
  {"lora_name"} change the set at run time. Like vLLM, only when the environment allows it
  (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, or FERROX_ALLOW_RUNTIME_LORA_UPDATING=true). Refused
  otherwise (404 naming the variable). A client names a folder on the server's disk, so loading is
  also limited to the folders given with --lora-allowed-dirs (ferrox's own flag; none by default),
  checked after resolving symlinks and `..`: no route reads a file outside them (403 otherwise).
  Unloading while requests run with the adapter lets them finish first.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from ferrox.entrypoints.openai.errors import APIError, from_exception
from ferrox.errors import FerroxError

if TYPE_CHECKING:
    from ferrox.engine.async_llm import AsyncLLM
    from ferrox.lora.request import LoRARequest

RUNTIME_UPDATE_VARS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "FERROX_ALLOW_RUNTIME_LORA_UPDATING")


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One --lora-modules entry: `name=path` or a JSON object {"name", "path", "base_model_name"}."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    text = text.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
            raise ValueError(f"--lora-modules: {text!r} needs string fields \"name\" and \"path\"")
        unknown = set(obj) - {"name", "path", "base_model_name"}
        if unknown:
            raise ValueError(f"--lora-modules: unknown field(s) {', '.join(sorted(unknown))} in {text!r}")
        return LoRAModule(obj["name"], obj["path"], obj.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {text!r} is not name=path (or a JSON object)")
    return LoRAModule(name, path)


def runtime_updates_allowed() -> bool:
    return any(os.environ.get(var, "").strip().lower() in ("1", "true") for var in RUNTIME_UPDATE_VARS)


class LoRARegistry:
    """The adapters this server answers to, by name; ids are handed out in order from 1."""

    def __init__(self, engine: AsyncLLM, base_model_name: str, *, allowed_dirs: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.base_model_name = base_model_name
        self.allowed_dirs = tuple(os.path.realpath(d) for d in allowed_dirs)
        self.by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    def get(self, model: str | None) -> LoRARequest | None:
        return self.by_name.get(model) if model is not None else None

    async def load(self, name: str, path: str) -> LoRARequest:
        from ferrox.lora.request import LoRARequest

        if name in self.by_name:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                           code="invalid_value")
        if name == self.base_model_name:
            raise APIError(400, f"lora_name: '{name}' is the base model's name", param="lora_name")
        request = LoRARequest(name, self._next_id, os.path.abspath(path))
        try:
            await self.engine.add_lora(request)
        except FerroxError as e:  # a bad adapter: 400 naming its file and field
            raise from_exception(e, default_param="lora_path") from None
        self._next_id += 1
        self.by_name[name] = request
        return request

    async def unload(self, name: str) -> None:
        request = self.by_name.pop(name, None)
        if request is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        await self.engine.remove_lora(request.lora_int_id)

    def model_cards(self, created: int, max_model_len: int) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "ferrox", "root": r.lora_path,
                 "parent": self.base_model_name, "max_model_len": max_model_len} for name, r in self.by_name.items()]


# ---- routes --------------------------------------------------------------------------------------
async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    return body


def _name(body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise APIError(400, "lora_name: required (a non-empty string)", param="lora_name")
    return name


def _check_allowed(registry: LoRARegistry) -> None:
    if not runtime_updates_allowed():
        raise APIError(404, "loading and unloading LoRA adapters at run time is off; set "
                       "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true in the server's environment to allow it",
                       code="not_found")
    if not registry.engine.config.enable_lora:
        raise APIError(400, "LoRA is not enabled on this server (start it with --enable-lora)", param="lora_name")


def _check_inside_allowed(registry: LoRARegistry, path: str) -> None:
    real = os.path.realpath(path)
    if not registry.allowed_dirs:
        raise APIError(403, "lora_path: loading adapters at run time needs --lora-allowed-dirs (the folders it may "
                       "read from)", param="lora_path", code="forbidden")
    if not any(os.path.commonpath([real, d]) == d for d in registry.allowed_dirs):
        raise APIError(403, "lora_path: not inside a folder this server allows (--lora-allowed-dirs)",
                       param="lora_path", code="forbidden")


async def load_lora_adapter(registry: LoRARegistry, request: web.Request) -> web.Response:
    """Load a LoRA adapter folder under a name clients can put in `model` (vLLM's route)."""
    _check_allowed(registry)
    body = await _body(request)
    name = _name(body)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise APIError(400, "lora_path: required (the adapter's folder)", param="lora_path")
    _check_inside_allowed(registry, path)
    await registry.load(name, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(registry: LoRARegistry, request: web.Request) -> web.Response:
    """Unload a LoRA adapter by name; requests still running with it finish first."""
    _check_allowed(registry)
    name = _name(await _body(request))
    await registry.unload(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
