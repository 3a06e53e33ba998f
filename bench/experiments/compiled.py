"""A copy of this checkout's slotgate with its request path compiled by mypyc, for the bench to
measure beside the interpreted one (`--slotgate-tree DIR`).

    python -m bench.experiments.compiled DIR [--modules slotgate/proxy/relay.py,...]

Copies app/ to DIR/slotgate and compiles the modules a relayed request runs through (the
admission core, the relay, intake, metrics and the upstream client) into C extensions beside
their sources, where Python imports them first. Needs mypy (the test extras), setuptools and a
C compiler. The protocol and the request cycle stay interpreted: they subclass uvicorn's
classes, which mypyc does not compile, and an interpreted class cannot subclass a compiled
one (so the upstream client's subclass, reuse.py, is compiled with it).

The same modules as slotgate's compiled build (setup.py, SLOTGATE_COMPILE=1), compiled in a
copy so that a checkout can measure both; `--modules` compiles a subset, to find which module
a difference comes from.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from bench.contenders import REPO

#: The modules the compiled build compiles (pyproject.toml's [tool.slotgate] compiled, setup.py).
MODULES = tuple(
    f"slotgate/{module}"
    for module in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["slotgate"][
        "compiled"
    ]
)

_SETUP = """
import sys
from setuptools import setup
from mypyc.build import mypycify
modules, sys.argv[3:] = sys.argv[3:], []
setup(name="slotgate-compiled", ext_modules=mypycify(modules, opt_level="3"))
"""


def build(target: Path, modules: tuple[str, ...] = MODULES) -> None:
    """DIR/slotgate: this checkout's app/, with `modules` compiled beside their sources."""
    package = target / "slotgate"
    if package.exists():
        shutil.rmtree(package)
    target.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "app", package, ignore=shutil.ignore_patterns("__pycache__"))
    with tempfile.TemporaryDirectory(prefix="slotgate-mypyc-") as scratch:
        setup = Path(scratch) / "setup.py"
        setup.write_text(_SETUP)
        subprocess.run(
            [sys.executable, str(setup), "build_ext", "--inplace", *modules],
            cwd=target,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    shutil.rmtree(target / "build", ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="the folder to hold the compiled slotgate/")
    parser.add_argument("--modules", help="comma-separated paths under the target (default: all)")
    args = parser.parse_args(argv)
    modules = tuple(args.modules.split(",")) if args.modules else MODULES
    build(args.target.resolve(), modules)
    print(f"compiled {len(modules)} modules into {args.target}/slotgate")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
