"""setup.py, the compiled build's switches: what SLOTGATE_COMPILE and SLOTGATE_PROFILE may
say, and the one line they stop the build with when they say something else. (The build itself
is the docker tier's and scripts/check's.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _setup(compile_value: str, **more: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLOTGATE_COMPILE": compile_value, **more}
    return subprocess.run(
        [sys.executable, "setup.py", "--name"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("value", ["", "0", "false", "No"])
def test_an_unset_or_negative_switch_builds_the_plain_package(value: str) -> None:
    done = _setup(value)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "slotgate"


@pytest.mark.parametrize(
    ("value", "named"),
    [("2", "'2'"), ("gate/nonesuch.py", "'gate/nonesuch.py'"), ("gate/line.py,relay", "'relay'")],
)
def test_a_switch_that_is_neither_yes_nor_modules_stops_the_build_naming_it(
    value: str, named: str
) -> None:
    done = _setup(value)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"SLOTGATE_COMPILE={value!r}")
    assert f"({named} is none)" in lines[0]


def test_a_profile_folder_without_a_profile_stops_the_build_naming_it(tmp_path: Path) -> None:
    done = _setup("1", SLOTGATE_PROFILE=str(tmp_path))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"SLOTGATE_PROFILE={str(tmp_path)!r} holds no profile")


def test_the_training_s_build_and_the_guided_one_cannot_both_be_asked_for(tmp_path: Path) -> None:
    (tmp_path / "a.gcda").write_bytes(b"")
    done = _setup("1", SLOTGATE_PROFILE=str(tmp_path), SLOTGATE_PROFILE_GENERATE=str(tmp_path))
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("SLOTGATE_PROFILE_GENERATE and SLOTGATE_PROFILE are both set")
