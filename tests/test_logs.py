"""Log lines: what a client sends cannot add a line or raw control bytes to any format."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import sys
from collections.abc import Iterator

import pytest
from slotgate.logs import JsonFormatter, TextFormatter, escape

from tests.conftest import GateFactory

FORGED = "2026-11-30 23:00:00,000 INFO slotgate.access GET /admission 200 served"
# A newline (and a forged line after it), a NUL, a DEL, a C1 control, a Unicode line
# separator, and a backslash written as if it were already an escape.
PATH = ("/v1/models%0a" + FORGED.replace(" ", "%20") + "/%00/%7f/%c2%85/%e2%80%a8/%5cx0a").encode()


@pytest.fixture
def written() -> Iterator[dict[str, io.StringIO]]:
    """What the access log writes in each format."""
    logger = logging.getLogger("slotgate.access")
    outputs = {"text": io.StringIO(), "json": io.StringIO()}
    handlers = []
    for name, formatter in (("text", TextFormatter()), ("json", JsonFormatter())):
        handler = logging.StreamHandler(outputs[name])
        handler.setFormatter(formatter)
        handlers.append(handler)
        logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield outputs
    logger.setLevel(level)
    for handler in handlers:
        logger.removeHandler(handler)


async def request(port: int, method: bytes, target: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % (method, target))
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_a_path_with_control_characters_stays_on_one_escaped_access_line(
    start_gate: GateFactory, written: dict[str, io.StringIO]
) -> None:
    gate = await start_gate()
    for method in (b"GET", b"POST"):
        assert (await request(gate.port, method, PATH)).startswith(b"HTTP/1.1 ")
    text = written["text"].getvalue().splitlines()
    assert len(text) == 2
    for line in text:
        assert line.isprintable()
        assert "/v1/models\\x0a2026-11-30 23:00:00,000 INFO" in line
        assert "/\\x00/\\x7f/\\x85/\\u2028/\\\\x0a" in line
    decoded = "/v1/models\n" + FORGED + "/\x00/\x7f/\x85/\u2028/\\x0a"
    lines = written["json"].getvalue().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert line.isprintable()
        assert decoded in json.loads(line)["msg"]


def test_extra_fields_and_arguments_are_escaped_but_a_traceback_keeps_its_lines() -> None:
    def boom() -> None:
        raise ValueError("boom")

    try:
        boom()
    except ValueError:
        record = logging.LogRecord(
            "slotgate", logging.ERROR, __file__, 1, "upstream said %s", ("a\r\nb",),
            exc_info=sys.exc_info(),
        )  # fmt: skip
    record.route = "/x\ny"
    line = TextFormatter().format(record)
    first, *trace = line.splitlines()
    assert first.endswith("upstream said a\\x0d\\x0ab")
    assert trace[0] == "Traceback (most recent call last):"
    assert "ValueError: boom" in trace[-1]
    assert line.endswith(' route="/x\\x0ay"')


def test_plain_text_is_left_as_it_is() -> None:
    assert escape("POST /v1/chat/completions 200 served é 中") == (
        "POST /v1/chat/completions 200 served é 中"
    )


def fields(line: str) -> list[tuple[str, str]]:
    """The key=value pairs of a text line, read as logfmt does (a quoted value may hold
    spaces, `=` and escaped quotes)."""
    quoted = r'"(?:[^"\\]|\\.)*"'
    pairs = re.findall(rf'{quoted}|(?:^| )([a-z_]+)=({quoted}|[^ "]*)', line)
    return [(key, value) for key, value in pairs if key]


async def test_a_path_with_spaces_and_equals_signs_cannot_forge_access_log_fields(
    start_gate: GateFactory, written: dict[str, io.StringIO]
) -> None:
    gate = await start_gate()
    forged = b"/v1/models%20status=500%20tenant=admin%20outcome=%22x%20y%22"
    assert (await request(gate.port, b"GET", forged)).startswith(b"HTTP/1.1 200")
    (line,) = written["text"].getvalue().splitlines()
    keys = [key for key, _ in fields(line)]
    assert len(keys) == len(set(keys)), line
    assert dict(fields(line))["status"] == "200"
    assert dict(fields(line))["tenant"] == "default"
    assert '"/v1/models status=500 tenant=admin outcome=\\"x y\\""' in line
    (entry,) = (json.loads(text) for text in written["json"].getvalue().splitlines())
    assert entry["status"] == 200
    assert entry["tenant"] == "default"


def test_text_field_values_with_spaces_quotes_or_equals_signs_are_quoted() -> None:
    record = logging.LogRecord("slotgate", logging.INFO, __file__, 1, "m", (), None)
    record.plain = "abc"
    record.spaced = "a b"
    record.quoted = 'say "hi"\\'
    record.equals = "k=v"
    record.empty = ""
    line = TextFormatter().format(record)
    assert line.endswith(
        ' plain=abc spaced="a b" quoted="say \\"hi\\"\\\\" equals="k=v" empty=""'
    ), line
