"""How a ferrox process sets up logging: the level and line format it is given, or vLLM's logging config
file -- `ferrox serve --log-config-file PATH` or VLLM_LOGGING_CONFIG_PATH, a JSON object for
logging.config.dictConfig (structured logs for a log pipeline, per-logger levels) -- in the API server and
every engine-core process alike (the flag sets the variable, which the cores inherit). VLLM_CONFIGURE_LOGGING=0
leaves logging as the embedding program set it, as vLLM does."""

from __future__ import annotations

import json
import logging
import logging.config
import os

CONFIG_PATH_ENV = "VLLM_LOGGING_CONFIG_PATH"
CONFIGURE_ENV = "VLLM_CONFIGURE_LOGGING"


def read_logging_config(path: str) -> dict:
    """The file's dictConfig object; a missing file or bad JSON is a ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as exc:
        raise ValueError(f"logging config {path!r}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"logging config {path!r}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"logging config {path!r}: must be a JSON object (logging.config.dictConfig's schema)")
    return config


def configure_logging(level: str, fmt: str) -> None:
    """basicConfig(level, fmt), or the logging config file when one is named (its own levels and formats)."""
    if os.environ.get(CONFIGURE_ENV, "1") == "0":
        return
    path = os.environ.get(CONFIG_PATH_ENV)
    if path:
        try:
            logging.config.dictConfig(read_logging_config(path))
        except (TypeError, AttributeError, ImportError) as exc:  # dictConfig's own errors (its ValueError passes)
            raise ValueError(f"logging config {path!r}: {exc}") from None
        return
    logging.basicConfig(level=level.upper(), format=fmt)
