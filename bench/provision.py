"""Installs what the bench needs and is missing: nginx and wrk (apt), LiteLLM, matplotlib."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

from bench.contenders import LITELLM_VENV, litellm_binary, nginx_binary


def _wrk() -> str | None:
    return shutil.which("wrk")


_APT = {"nginx-light": nginx_binary, "wrk": _wrk}


def tools(notes: list[str]) -> None:
    missing = [package for package, present in _APT.items() if not present()]
    if not missing:
        return
    if os.geteuid() != 0:
        notes.append(
            f"not root, so {' and '.join(missing)} not installed: "
            "the nginx contender is skipped and the Python load generator replaces wrk"
        )
        return
    print(f"bench: apt-get install {' '.join(missing)}", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=False, env=env, timeout=600)
    done = subprocess.run(
        ["apt-get", "install", "-y", "-qq", *missing], check=False, env=env, timeout=900
    )
    if done.returncode != 0:
        notes.append(f"apt-get install {' '.join(missing)} failed (exit {done.returncode})")
    if "nginx-light" in missing and shutil.which("service"):
        # Debian's package starts a system nginx on port 80; the bench runs its own.
        subprocess.run(["service", "nginx", "stop"], check=False, capture_output=True, timeout=60)


def litellm(notes: list[str]) -> None:
    if litellm_binary() is not None:
        return
    print(f"bench: installing LiteLLM's proxy into {LITELLM_VENV}", flush=True)
    created = subprocess.run(
        [sys.executable, "-m", "venv", str(LITELLM_VENV)], check=False, timeout=300
    )
    pip = LITELLM_VENV / "bin" / "pip"
    if created.returncode == 0:
        subprocess.run([str(pip), "install", "-q", "litellm[proxy]"], check=False, timeout=1800)
    if litellm_binary() is None:
        notes.append("LiteLLM could not be installed: its contender is skipped")


def matplotlib(notes: list[str]) -> None:
    if importlib.util.find_spec("matplotlib") is not None:
        return
    print("bench: pip install matplotlib", flush=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "matplotlib"], check=False, timeout=900
    )
    importlib.invalidate_caches()
    if importlib.util.find_spec("matplotlib") is None:
        notes.append("matplotlib could not be installed: no plots")


def everything(notes: list[str], want_litellm: bool) -> None:
    tools(notes)
    if want_litellm:
        litellm(notes)
    matplotlib(notes)
