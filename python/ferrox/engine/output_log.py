"""vLLM's --enable-log-outputs: one info line per finished choice of a generation request -- its text,
token ids and finish reason -- on the request log (`ferrox.requests`, where --enable-log-requests puts
each request's parameters), so the two read as a pair by request id.

A streamed request's outputs arrive as deltas: each choice's text and ids are gathered here until the
request finishes, so the line holds the whole answer whatever the route streamed. With vLLM's
--enable-log-deltas (its default; --disable-log-deltas turns it off) each delta of a streamed request is
also logged as it goes out, one line per choice that got text or tokens ("(streaming delta)"), before the
whole answer's line. Strings and id lists longer than --max-log-len are cut as the request lines cut
them (`shorten`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ferrox.outputs import RequestOutput

request_logger = logging.getLogger("ferrox.requests")


def shorten(value: Any, limit: int | None) -> Any:
    """value with strings longer than limit and id lists longer than limit cut (None: no limit)."""
    if isinstance(value, str):
        return value if limit is None or len(value) <= limit else f"{value[:limit]}...<{len(value)} chars>"
    if isinstance(value, dict):
        return {k: shorten(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        if limit is not None and len(value) > limit and all(isinstance(v, int) for v in value):
            return [*value[:limit], f"...<{len(value)} ids>"]
        return [shorten(v, limit) for v in value]
    return value


class OutputLog:
    def __init__(self, max_log_len: int | None = None, log_deltas: bool = False) -> None:
        self.max_log_len = max_log_len
        self.log_deltas = log_deltas  # vLLM's --enable-log-deltas: each streamed delta gets a line too
        # request id -> choice index -> (text so far, token ids so far)
        self._open: dict[str, dict[int, tuple[str, list[int]]]] = {}

    def observe(self, out: RequestOutput, delta: bool) -> None:
        """One output of a request (delta: it carries only what is new); logs the choices once it finishes."""
        choices = self._open.setdefault(out.request_id, {})
        for choice in out.outputs:
            text, ids = choices.get(choice.index, ("", []))
            if delta:
                choices[choice.index] = (text + choice.text, ids + list(choice.token_ids))
                if self.log_deltas and (choice.text or choice.token_ids):
                    request_logger.info("response %s (streaming delta): choice %d: %s; output_token_ids: %s",
                                        out.request_id, choice.index,
                                        json.dumps(shorten(choice.text, self.max_log_len), ensure_ascii=False),
                                        shorten(list(choice.token_ids), self.max_log_len))
            else:
                choices[choice.index] = (choice.text, list(choice.token_ids))
        if not out.finished:
            return
        del self._open[out.request_id]
        reasons = {c.index: c.finish_reason for c in out.outputs}
        for index, (text, ids) in sorted(choices.items()):
            request_logger.info("response %s: choice %d, finish_reason %s, %d tokens: %s; output_token_ids: %s",
                                out.request_id, index, reasons.get(index), len(ids),
                                json.dumps(shorten(text, self.max_log_len), ensure_ascii=False),
                                shorten(ids, self.max_log_len))

    def forget(self, request_id: str) -> None:
        """A request left without a finished output (its client went away): nothing to log."""
        self._open.pop(request_id, None)
