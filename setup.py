"""slotgate's build: everything is declared in pyproject.toml; this file only adds the compiled
build. With SLOTGATE_COMPILE=1, mypyc (part of mypy) compiles the modules a relayed request runs
through, listed in pyproject.toml under [tool.slotgate] compiled, into C extensions installed
beside their sources; Python imports those first. It needs a C compiler, the Python headers,
and mypy and setuptools installed beside slotgate's dependencies, as mypyc type-checks what it
compiles against them (docs/performance.md):

    pip install . && pip install mypy 'setuptools>=77'
    SLOTGATE_COMPILE=1 pip install --no-build-isolation --no-deps --force-reinstall .

SLOTGATE_COMPILE may instead name modules, comma-separated paths under app/ (proxy/relay.py,
gate/line.py): only those are compiled, to measure what one module's compiling is worth
(python -m bench.experiments.compiled).
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path
from typing import Any

from setuptools import setup

ROOT = Path(__file__).parent


def compiled_modules() -> list[Any]:
    """The extensions to build: none unless SLOTGATE_COMPILE asks for them."""
    wanted = os.environ.get("SLOTGATE_COMPILE", "").strip()
    if wanted.lower() in ("", "0", "false", "no"):
        return []
    if wanted.lower() in ("1", "true", "yes"):
        with open(ROOT / "pyproject.toml", "rb") as pyproject:
            modules = tomllib.load(pyproject)["tool"]["slotgate"]["compiled"]
    else:
        modules = [module.strip() for module in wanted.split(",")]
        missing = [module for module in modules if not (ROOT / "app" / module).is_file()]
        if missing:
            sys.exit(
                f"SLOTGATE_COMPILE={wanted!r}: set it to 1 to compile, to paths under app/ to"
                f" compile only those ({missing[0]!r} is none), or leave it unset"
            )
    try:
        from mypyc.build import mypycify
    except ImportError:
        sys.exit(
            "SLOTGATE_COMPILE=1 needs mypy where slotgate is built: pip install mypy"
            " 'setuptools>=77', then build with pip install --no-build-isolation"
        )
    # Through .types/slotgate (a link to app/), as `mypy` checks them: the modules are named
    # slotgate.*, the name they are installed and imported under.
    os.chdir(ROOT)
    return list(
        mypycify(
            [f".types/slotgate/{module}" for module in modules],
            opt_level="3",
            group_name="slotgate",
        )
    )


setup(ext_modules=compiled_modules())
