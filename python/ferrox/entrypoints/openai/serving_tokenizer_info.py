"""GET /tokenizer_info (vLLM's, registered only with --enable-tokenizer-info-endpoint: it shows the chat
template and the tokenizer's configuration): the model folder's tokenizer_config.json as transformers
would hold it after loading, without file paths, with added-token entries reduced to their text,
plus `tokenizer_class` (the folder's) and the chat template the server uses.
A GGUF model has no tokenizer_config.json: its special tokens and template stand in."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ferrox.entrypoints.openai.serving import CTX

_PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file")


def _plain(value: Any) -> Any:
    """An AddedToken entry ({"content": ..., "lstrip": ...}) is its text, as vLLM serializes them."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return value["content"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def tokenizer_info(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    info = {k: _plain(v) for k, v in tokenizer.config.items() if k not in _PATH_FIELDS}
    for name, token in tokenizer.special_tokens.items():
        info.setdefault(name, token)
    # vLLM reports the class transformers instantiated, a name that depends on its version (4.x:
    # "LlamaTokenizerFast"; 5.x: "TokenizersBackend" for the generic one); the folder's declared class is
    # what any version loads it by.
    info["tokenizer_class"] = str(info.get("tokenizer_class") or "PreTrainedTokenizerFast")
    template = chat_template or tokenizer.chat_templates.get("default")
    if template:
        info["chat_template"] = template
    return info


async def get_tokenizer_info(request: web.Request) -> web.Response:
    engine = request.app[CTX].engine
    return web.json_response(tokenizer_info(engine.tokenizer, engine.chat_template))
