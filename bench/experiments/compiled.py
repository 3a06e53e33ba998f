"""slotgate's compiled build of this checkout, in a folder of its own, for the bench to measure
beside the interpreted one (`--slotgate-tree DIR`).

    python -m bench.experiments.compiled DIR [--modules proxy/relay.py,gate/line.py,...]

Builds through setup.py, as the image and scripts/check do (`SLOTGATE_COMPILE`, docs/
performance.md), from a copy of the checkout so that the checkout's own build/ folder is left
alone: DIR/slotgate is the package, with the modules pyproject.toml lists under
`[tool.slotgate] compiled` as C extensions beside their sources. `--modules` compiles only
those (paths under app/, listed or not), to find which module a difference comes from. Needs
mypy and setuptools (the test extras) and a C compiler.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.contenders import REPO

#: What setup.py builds from: the package, its type-checking link, and the project's files.
_SOURCES = ("app", ".types", "setup.py", "pyproject.toml", "README.md")


def build(target: Path, modules: tuple[str, ...] = ()) -> None:
    """DIR/slotgate: this checkout's slotgate, built with `modules` (default: the listed ones)
    compiled."""
    with tempfile.TemporaryDirectory(prefix="slotgate-compiled-") as scratch:
        source = Path(scratch) / "slotgate"
        source.mkdir()
        for name in _SOURCES:
            path = REPO / name
            if path.is_dir():
                shutil.copytree(
                    path,
                    source / name,
                    symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"),
                )
            else:
                shutil.copy2(path, source / name)
        env = {**os.environ, "SLOTGATE_COMPILE": ",".join(modules) if modules else "1"}
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-build-isolation",
                "--no-deps",
                "--upgrade",
                "--target",
                str(target),
                str(source),
            ],
            env=env,
            check=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="the folder to hold the compiled slotgate/")
    parser.add_argument(
        "--modules", help="comma-separated paths under app/ (default: pyproject.toml's list)"
    )
    args = parser.parse_args(argv)
    modules = tuple(args.modules.split(",")) if args.modules else ()
    build(args.target.resolve(), modules)
    print(f"built slotgate into {args.target}, {args.modules or 'the listed modules'} compiled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
