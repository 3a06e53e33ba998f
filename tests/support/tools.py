"""System tools some tests need (promtool, nginx, chromium, a router-capable llama-server).

On a person's machine a missing tool skips the tests that need it, with the Debian package to
install in the reason. Under CI (`CI=true`, which `.ci/run` sets after installing them) a
missing tool fails those tests instead: a skip there would hide a check that never ran.
"""

from __future__ import annotations

import os
import shutil

import pytest


def required() -> bool:
    """True where every tool must be present (CI), so that absence is a failure."""
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def tool(name: str, package: str, *, extra_path: str = "/usr/sbin:/sbin") -> str:
    """The path of `name`; skips (or fails under CI) naming the Debian package when absent."""
    found = shutil.which(name) or shutil.which(name, path=extra_path)
    if found is not None:
        return found
    message = f"{name} is not installed (Debian: apt-get install {package})"
    if required():
        pytest.fail(message + "; CI installs it in .ci/run")
    pytest.skip(message)
