"""GET /openapi.json: an OpenAPI 3.1 description of the server, built from what it really serves.

The paths come from the aiohttp route table (so a route added there appears here), each
operation's summary from its handler's docstring, and request bodies from the pydantic models
the handlers validate with (their JSON schemas, shared under components/schemas): a JSON body, or
a multipart/form-data one for the routes that take files (the speech-to-text routes).
"""

from __future__ import annotations

import inspect
from typing import Any

from aiohttp import web
from pydantic import BaseModel

import ferrox

_ERROR_SCHEMA = {
    "type": "object",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def _summary(handler: Any) -> str:
    doc = inspect.getdoc(handler) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def _operation(method: str, path: str, handler: Any, model: type[BaseModel] | None,
               schemas: dict[str, Any], open_paths: frozenset[str],
               media_type: str = "application/json") -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": f"{method}_{handler.__name__}"}
    summary = _summary(handler)
    if summary:
        op["summary"] = summary
    params = [seg[1:-1] for seg in path.split("/") if seg.startswith("{") and seg.endswith("}")]
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                            for p in params]
    if model is not None:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        op["requestBody"] = {"required": True, "content": {
            media_type: {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    op["responses"] = {
        "200": {"description": "success (JSON; text/event-stream when the body asks to stream)"},
        "default": {"description": "error", "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}},
    }
    if path in open_paths:
        op["security"] = []  # probes, scrapers and the page carry no credentials
    return op


def build_openapi(router: web.UrlDispatcher, request_models: dict[str, type[BaseModel]],
                  open_paths: frozenset[str], *, api_key: bool,
                  form_models: dict[str, type[BaseModel]] | None = None) -> dict[str, Any]:
    """`request_models` maps a route's path to the pydantic model of its JSON body, `form_models` to that of
    its multipart form; `api_key`: whether the server asks for one (then every path outside `open_paths`
    does)."""
    paths: dict[str, dict[str, Any]] = {}
    schemas: dict[str, Any] = {"Error": _ERROR_SCHEMA}
    for route in router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path is None or route.method in ("HEAD", "*"):  # static files; HEAD mirrors GET
            continue
        form = (form_models or {}).get(path) if route.method == "POST" else None
        model = form or (request_models.get(path) if route.method == "POST" else None)
        paths.setdefault(path, {})[route.method.lower()] = _operation(
            route.method.lower(), path, route.handler, model, schemas, open_paths,
            "multipart/form-data" if form is not None else "application/json")
    spec: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "ferrox", "version": ferrox.__version__,
                 "description": "OpenAI- and Anthropic-compatible LLM serving API."},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if api_key:
        spec["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
        spec["security"] = [{"bearer": []}, {"x-api-key": []}]
    return spec
