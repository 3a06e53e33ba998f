"""Logging set-up: plain text or one JSON object per line, and the per-request record.

A record can carry what a client sent (a path with `%0a` or `%00` in it, a header): in the
text format every control character, the Unicode line breaks and the backslash are written as
escapes, so one record is always one line and cannot forge another; the JSON format escapes
them as JSON does. Nor can it forge a field of its own line: in the text format a field's
value, and an argument marked `Client` (a path), is written as logfmt does, in double quotes
with `"` and `\\` escaped when it holds a space, a quote, `=` or a control character.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

#: Attributes of a LogRecord that are logging's own, not fields a caller passed in `extra`.
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "color_message",
}

access = logging.getLogger("slotgate.access")

#: C0 and C1 controls, DEL, the Unicode line and paragraph separators, and the backslash (so
#: that a client's own `\x0a` cannot pass for an escaped one).
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\\]")


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    if char == "\\":
        return "\\\\"
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(text: str) -> str:
    """`text` on one line, its control characters written as \\xNN (or \\uNNNN)."""
    return _UNSAFE.sub(_escaped, text) if _UNSAFE.search(text) else text


#: A value logfmt can take as it is: no space, quote, `=`, backslash or control character.
_BARE = re.compile(r'[^\s"=\\\x00-\x1f\x7f-\x9f]+')


def quote(text: str) -> str:
    """`text` as one logfmt value: as it is when it is one plain word, else quoted."""
    if _BARE.fullmatch(text):
        return text
    return '"' + escape(text).replace('"', '\\"') + '"'


class Client(str):
    """Text a client chose, logged as an argument: quoted in the text format, so that a path
    such as `/v1/models status=500` stays one value."""

    __slots__ = ()


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and every `extra` field."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update((k, v) for k, v in vars(record).items() if k not in _RESERVED)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """Readable lines; `extra` fields follow the message as key=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        # The message only: a traceback logging appends after it keeps its lines.
        args = record.args
        if isinstance(args, tuple) and any(type(arg) is Client for arg in args):
            record.message = escape(str(record.msg)) % tuple(
                quote(arg) if type(arg) is Client else escape(arg) if isinstance(arg, str) else arg
                for arg in args
            )
        else:
            record.message = escape(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = " ".join(
            f"{k}={quote(str(v))}" for k, v in vars(record).items() if k not in _RESERVED
        )
        return f"{line} {fields}" if fields else line


def configure(level: str, fmt: str) -> None:
    """Route slotgate's and uvicorn's loggers to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # slotgate writes its own access line, with the queue fields uvicorn cannot know.
    logging.getLogger("uvicorn.access").disabled = True
