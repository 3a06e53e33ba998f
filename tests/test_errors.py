"""Refusals as HTTP answers: the retry headers."""

from __future__ import annotations

import pytest
from slotgate.errors import retry_headers


@pytest.mark.parametrize(
    ("retry_after_s", "seconds", "milliseconds"),
    [
        (0.2, "1", "200"),
        (1.0, "1", "1000"),
        (1.49, "1", "1490"),
        (1.5, "2", "1500"),
        (2.5, "3", "2500"),
        (2.75, "3", "2750"),
        (3.2, "3", "3200"),
        (59.6, "60", "59600"),
    ],
)
def test_retry_after_is_retry_after_ms_rounded_to_the_nearest_second_and_at_least_one(
    retry_after_s: float, seconds: str, milliseconds: str
) -> None:
    headers = dict(retry_headers(retry_after_s))
    assert headers[b"retry-after"] == seconds.encode()
    assert headers[b"retry-after-ms"] == milliseconds.encode()
    assert headers[b"x-should-retry"] == b"true"
