"""Formats whose tool calls are JSON call objects after a marker: a list
`[{"name": ..., "arguments": {...}}, ...]` (granite, phi4_mini_json, xlam) or one object per marker
(granite-20b-fc). A CallListFormat names the markers; CallListReader reads a reply in pieces.

What counts as calls, the same whole or streamed:
- a marker, then (after whitespace, or another marker: Granite may write `<|tool_call|><tool_call>`)
  the list; or, where the format allows it, a reply that starts with the list and no marker;
- each item is an object with a string "name" and an "arguments" (or "parameters") member: JSON that
  is no call, such as `[{"name": "Bob", "age": 3}]`, stays the answer;
- text before the marker is content, and so is text after the list (a closing fence or tag that
  belongs to the markup is dropped); a list that stops at something that is no call keeps the calls
  before it, and the rest is content; a marker followed by no call at all is content.

Streaming sends each call's id and name once its name is complete and its arguments have begun,
then the arguments' raw JSON text as it grows (CallStreamer), as hermes and llama3_json do. A call
whose name went out cannot be taken back: if its object then proves broken (or is cut short), the
stream keeps it where extract(), which sees the whole object first, does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ferrox.entrypoints.openai.tool_parsers.base import (
    CallStreamer,
    ContentGate,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    call_from_body,
    held_back,
)

_WS = " \t\r\n"

# Reader states: what the next text is expected to be.
_LEAD = 0  # the reply's start (only whitespace so far): a bare list may begin here
_TEXT = 1  # content, up to the next marker
_OPENED = 2  # after a marker: whitespace or more markers, then '[' (or '{' for one object)
_ITEMS = 3  # inside the list, before an item: '{' or ']'
_ITEM = 4  # inside a call object (the CallStreamer reads it)
_AFTER_ITEM = 5  # after a call object: ',' or ']'
_CLOSING = 6  # after the list: a closing fence or tag to drop, if one follows


@dataclass(frozen=True, slots=True)
class CallListFormat:
    markers: tuple[str, ...]  # text after which calls follow
    closers: tuple[str, ...] = ()  # text after the list that is markup, not content
    bare_list: bool = False  # a reply that starts with a list of calls needs no marker
    one_object: bool = False  # each marker is followed by one call object, not a list


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _may_become(text: str, i: int, words: tuple[str, ...]) -> bool:
    """text[i:] is a proper prefix of one of words (so more text may complete it)."""
    return any(len(text) - i < len(w) and w.startswith(text[i:]) for w in words)


def _longest_at(text: str, i: int, words: tuple[str, ...]) -> str:
    """The longest of words that text holds at i ("" when none)."""
    return max((w for w in words if text.startswith(w, i)), key=len, default="")


def _find_marker(text: str, start: int, markers: tuple[str, ...], final: bool) -> tuple[int, str] | None:
    """The first marker at or after start: (where, which). which is "" while a longer marker may still
    match there (xlam's "```" may be the start of "```json")."""
    found = [p for p in (text.find(m, start) for m in markers) if p >= 0]
    if not found:
        return None
    at = min(found)
    marker = _longest_at(text, at, markers)
    if not final and _may_become(text, at, tuple(m for m in markers if len(m) > len(marker))):
        return at, ""
    return at, marker


class CallListReader:
    """Reads one reply in pieces (feed), keeping only text that may still change meaning: the first
    characters of a marker, whitespace whose role is not known yet, and the text of the segment
    (marker, '[', the open call) while it may still turn out to be no call.

    eager: send a call's name and arguments while its object is still arriving (streaming); otherwise
    each call goes out whole once its object has closed and parsed (extract)."""

    def __init__(self, fmt: CallListFormat, eager: bool) -> None:
        self.fmt = fmt
        self.eager = eager
        self.tools_called = False
        self._state = _LEAD if fmt.bare_list else _TEXT
        self._buf = ""  # the text being read: what was held back, then the new piece
        self._i = 0  # where reading stopped in _buf
        self._marker = ""  # the segment's first marker ("" for a bare list)
        self._prefix = ""  # the segment's text before its first item, kept while it has sent no call
        self._call: CallStreamer | None = None
        self._num_calls = 0
        self._segment_calls = 0  # calls of this segment that have gone out
        self._gate = ContentGate()

    def feed(self, text: str, final: bool = False) -> DeltaMessage:
        """Read on; final: the reply ends here."""
        out = DeltaMessage()
        self._buf, self._i = self._buf[self._i :] + text, 0
        while _STEPS[self._state](self, out, final):
            pass
        return out

    # ---- output ---------------------------------------------------------------------------------

    def _send(self, out: DeltaMessage, deltas: list[DeltaToolCall]) -> None:
        for delta in deltas:
            if delta.name is not None:  # a call's first delta
                self._gate.call()
                self._num_calls += 1
                self._segment_calls += 1
                self.tools_called = True
        out.tool_calls += deltas

    # ---- segments -------------------------------------------------------------------------------

    def _consume(self, j: int) -> None:
        """Reading moves on to _buf[j]; the text passed over is kept while the segment may be no call."""
        if not self._segment_calls:
            self._prefix += self._buf[self._i : j]
        self._i = j

    def _begin_segment(self, marker: str, prefix: str, i: int, state: int) -> None:
        self._marker, self._prefix, self._segment_calls = marker, prefix, 0
        self._i, self._state = i, state

    def _no_call(self, out: DeltaMessage, pending: str) -> bool:
        """The segment holds no call: its marker is content, and the text after it (the prefix, then
        pending) is read again as text, where another marker may begin a segment."""
        self._gate.into(out, self._marker)
        self._buf, self._i = self._prefix[len(self._marker) :] + pending, 0
        self._prefix, self._state = "", _TEXT
        return True

    def _stop(self, out: DeltaMessage, j: int) -> bool:
        """The list stops at _buf[j], which continues no call: the calls so far stand and the text from
        j is content (all of it is, marker included, when no call went out)."""
        if not self._segment_calls:
            self._consume(j)
            return self._no_call(out, self._buf[j:])
        self._i, self._state = j, _TEXT
        return True

    # ---- states: each reads on and returns whether to go on (False: wait for more text) -------------

    def _lead(self, out: DeltaMessage, final: bool) -> bool:
        buf, markers = self._buf, self.fmt.markers
        j = _skip_ws(buf, self._i)
        if j == len(buf):
            self._state = _TEXT if final else _LEAD
            return final  # leading whitespace waits: it may precede a list
        if not final and _may_become(buf, j, markers):
            return False  # "[" may be xlam's "[TOOL_CALLS]"
        if buf[j] == "[" and not _longest_at(buf, j, markers):
            self._begin_segment("", buf[self._i : j + 1], j + 1, _ITEMS)
            return True
        self._state = _TEXT
        return True

    def _text(self, out: DeltaMessage, final: bool) -> bool:
        buf, i, markers = self._buf, self._i, self.fmt.markers
        hit = _find_marker(buf, i, markers, final)
        if hit is None:
            end = len(buf) if final else len(buf) - max(held_back(buf[i:], m) for m in markers)
            self._gate.into(out, buf[i:end])
            self._i = end
            return False
        at, marker = hit
        self._gate.into(out, buf[i:at])
        self._i = at
        if not marker:
            return False
        self._begin_segment(marker, marker, at + len(marker), _OPENED)
        return True

    def _opened(self, out: DeltaMessage, final: bool) -> bool:
        buf, markers = self._buf, self.fmt.markers
        j = _skip_ws(buf, self._i)
        while more := _longest_at(buf, j, markers):
            j = _skip_ws(buf, j + len(more))
        self._consume(j)
        if j == len(buf) or (not final and _may_become(buf, j, markers)):
            return self._no_call(out, buf[j:]) if final else False
        if buf[j] != ("{" if self.fmt.one_object else "["):
            return self._no_call(out, buf[j:])
        if self.fmt.one_object:
            self._start_item()
        else:
            self._consume(j + 1)
            self._state = _ITEMS
        return True

    def _items(self, out: DeltaMessage, final: bool) -> bool:
        buf = self._buf
        j = _skip_ws(buf, self._i)
        if j == len(buf):
            self._consume(j)
            return self._stop(out, j) if final else False
        if buf[j] == "{":
            self._consume(j)
            self._start_item()
            return True
        if buf[j] == "]" and self._segment_calls:  # (after a trailing comma too)
            self._i, self._state = j + 1, _CLOSING
            return True
        return self._stop(out, j)

    def _start_item(self) -> None:
        self._call = CallStreamer(self._num_calls)
        self._state = _ITEM

    def _item(self, out: DeltaMessage, final: bool) -> bool:
        call, buf, i = self._call, self._buf, self._i
        assert call is not None
        offset = call.length - i  # the call's offset of buf[0]
        call.feed(buf, i)
        self._i = len(buf)  # all of it is the call's now
        scan = call.scan
        sent = call.name is not None  # a call whose name went out stands, whatever follows
        if scan.error:
            if not sent:
                return self._bad_item(out, call.body(), "")
            assert scan.error_at is not None  # (the error shows in this piece: an item stops at its first)
            self._call, self._i, self._state = None, scan.error_at - offset, _TEXT
            return True
        if scan.end is not None:
            body, end = call.body()[: scan.end], scan.end - offset
            if not sent and (call.arguments is None or call_from_body(body) is None):
                return self._bad_item(out, body, buf[end:])
            self._send(out, call.deltas())
            self._call = None
            self._i, self._state = end, (_CLOSING if self.fmt.one_object else _AFTER_ITEM)
            return True
        if final:
            if not sent:
                return self._bad_item(out, call.body(), "")
            self._call, self._state = None, _TEXT  # cut short after its name went out
            return False
        if self.eager and call.arguments is not None:  # (a name alone may still be {"name": "Bob", ...})
            self._send(out, call.deltas())
        return False

    def _bad_item(self, out: DeltaMessage, item: str, rest: str) -> bool:
        """The item is no call: its text (and what follows) is read again as text."""
        self._call = None
        if not self._segment_calls:
            return self._no_call(out, item + rest)
        self._buf, self._i, self._state = item + rest, 0, _TEXT
        return True

    def _after_item(self, out: DeltaMessage, final: bool) -> bool:
        buf = self._buf
        j = _skip_ws(buf, self._i)
        if j == len(buf):
            self._state = _TEXT if final else _AFTER_ITEM
            return final
        if buf[j] == ",":
            self._i, self._state = j + 1, _ITEMS
        elif buf[j] == "]":
            self._i, self._state = j + 1, _CLOSING
        else:  # the list stops here: the calls so far stand, the rest is content
            self._state = _TEXT
        return True

    def _closing(self, out: DeltaMessage, final: bool) -> bool:
        buf, closers = self._buf, self.fmt.closers
        j = _skip_ws(buf, self._i)
        closer = _longest_at(buf, j, closers)
        if closer:
            self._i = j + len(closer)
        elif closers and not final and (j == len(buf) or _may_become(buf, j, closers)):
            return False
        self._state = _TEXT
        return True


# The reader's step per state, in the order of the state numbers (unbound: no reference cycle per reply).
_STEPS = (
    CallListReader._lead,
    CallListReader._text,
    CallListReader._opened,
    CallListReader._items,
    CallListReader._item,
    CallListReader._after_item,
    CallListReader._closing,
)


class CallListToolParser(ToolParser):
    """A ToolParser for one CallListFormat (the subclass names it)."""

    call_format: ClassVar[CallListFormat]

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._reader = CallListReader(self.call_format, eager=True)

    def extract(self, text: str) -> ExtractedToolCalls:
        reader = CallListReader(self.call_format, eager=False)
        message = reader.feed(text, final=True)
        calls: dict[int, ToolCall] = {}
        for delta in message.tool_calls:
            if delta.index in calls:
                calls[delta.index].arguments += delta.arguments or ""
            else:
                calls[delta.index] = ToolCall(
                    name=delta.name or "", arguments=delta.arguments or "", id=delta.id or ""
                )
        content = (message.content or "").strip() or None
        return ExtractedToolCalls(content=content, tool_calls=[calls[i] for i in sorted(calls)])

    def feed(self, delta: str) -> DeltaMessage:
        out = self._reader.feed(delta)
        self.tools_called = self._reader.tools_called
        return out

    def finish(self) -> DeltaMessage:
        out = self._reader.feed("", final=True)
        self.tools_called = self._reader.tools_called
        return out
