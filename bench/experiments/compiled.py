"""slotgate's compiled build of this checkout, in a folder of its own, for the bench to measure
beside the interpreted one (`--slotgate-tree DIR`).

    python -m bench.experiments.compiled DIR [--modules proxy/relay.py,gate/line.py,...]
        [--pgo]

Builds through setup.py, as the image and scripts/check do (`SLOTGATE_COMPILE`, docs/
performance.md), from a copy of the checkout so that the checkout's own build/ folder is left
alone: DIR/slotgate is the package, with the modules pyproject.toml lists under
`[tool.slotgate] compiled` as C extensions beside their sources. `--modules` compiles only
those (paths under app/, listed or not), to find which module a difference comes from.
`--pgo` builds with a training run first (bench/experiments/pgo.py), then guided by its
profile (an experiment: the image is built without). Needs mypy and setuptools (the test
extras) and a C compiler.
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
#: What the training run of a profile-guided build needs besides (bench/experiments/pgo.py).
_TRAINING = ("bench", "tests")


def build(target: Path, modules: tuple[str, ...] = (), *, pgo: bool = False) -> None:
    """DIR/slotgate: this checkout's slotgate, built with `modules` (default: the listed ones)
    compiled; with `pgo`, guided by a training run's profile."""
    with tempfile.TemporaryDirectory(prefix="slotgate-compiled-") as scratch:
        source = Path(scratch) / "slotgate"
        source.mkdir()
        for name in _SOURCES + (_TRAINING if pgo else ()):
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
        if pgo:
            profile = Path(scratch) / "profile"
            # From the copy, so that both builds compile the same paths (GCC finds an object's
            # profile by the object's path).
            subprocess.run(
                [sys.executable, "-m", "bench.experiments.pgo", str(profile)],
                cwd=source,
                check=True,
            )
            env["SLOTGATE_PROFILE"] = str(profile)
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
    parser.add_argument("--pgo", action="store_true", help="guided by a training run's profile")
    args = parser.parse_args(argv)
    if args.pgo and args.modules:
        parser.error("--pgo trains the whole compiled build: leave --modules out")
    modules = tuple(args.modules.split(",")) if args.modules else ()
    build(args.target.resolve(), modules, pgo=args.pgo)
    what = args.modules or "the listed modules"
    guided = ", guided by a training run" if args.pgo else ""
    print(f"built slotgate into {args.target}, {what} compiled{guided}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
