"""slotgate's build: everything is declared in pyproject.toml; this file only adds the compiled
build. With SLOTGATE_COMPILE=1, mypyc (part of mypy) compiles the modules a relayed request runs
through, listed in pyproject.toml under [tool.slotgate] compiled, into C extensions installed
beside their sources; Python imports those first. It needs a C compiler, the Python headers,
and mypy and setuptools installed beside slotgate's dependencies, as mypyc type-checks what it
compiles against them (docs/performance.md):

    pip install . && pip install mypy 'setuptools>=77'
    SLOTGATE_COMPILE=1 pip install --no-build-isolation --no-deps --force-reinstall .

SLOTGATE_PROFILE=DIR guides the C compiler by the profile a training run left in DIR
(python -m bench.experiments.pgo DIR, from this same folder): an experiment, measured in
bench/README.md; the image does not.

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
    # Hidden symbols: the shared library's some 2,900 functions are called by one another,
    # not by other libraries (a module's extension reaches it through a capsule; only
    # PyInit_*, which Python marks exported, must be seen). Visible, each of their 21,000 call
    # sites went through the PLT and none could be inlined. 2% fewer instructions per relayed
    # request, 4.5% fewer instruction-cache misses (bench/README.md).
    # Profile flags first, before mypyc's minute of work: a wrong setting stops it at once.
    flags = ["-fvisibility=hidden", *profile_flags()]
    # Through .types/slotgate (a link to app/), as `mypy` checks them: the modules are named
    # slotgate.*, the name they are installed and imported under.
    os.chdir(ROOT)
    extensions = list(
        mypycify(
            [f".types/slotgate/{module}" for module in modules],
            opt_level="3",
            group_name="slotgate",
        )
    )
    for extension in extensions:
        # New lists: mypycify's extensions share theirs.
        extension.extra_compile_args = [*extension.extra_compile_args, *flags]
        extension.extra_link_args = [*extension.extra_link_args, *flags]
    return extensions


def profile_flags() -> list[str]:
    """GCC's flags for a build guided by SLOTGATE_PROFILE, the folder a training run left its
    profile in (python -m bench.experiments.pgo); for the training's own build, instrumented to
    write that profile into SLOTGATE_PROFILE_GENERATE (which the training sets); none without
    either. Both go
    through here so that the two builds differ in nothing else: GCC refuses a profile whose
    functions were compiled otherwise.

    `-fprofile-partial-training`: what the training did not run is optimised as without a
    profile, not for size (a feature the training does not use must not run slower for it);
    `-Wno-missing-profile`: a module whose code the training never entered has no profile, and
    mypyc builds with -Werror.
    """
    folder = os.environ.get("SLOTGATE_PROFILE", "").strip()
    generate = os.environ.get("SLOTGATE_PROFILE_GENERATE", "").strip()
    if folder and generate:
        sys.exit(
            "SLOTGATE_PROFILE_GENERATE and SLOTGATE_PROFILE are both set: the first is the"
            " training's build (bench/experiments/pgo.py sets it), the second the final build's;"
            " set one"
        )
    if generate:
        return [f"-fprofile-generate={Path(generate).resolve()}", "-fprofile-update=single"]
    if not folder:
        return []
    profile = Path(folder).resolve()
    if not any(profile.glob("*.gcda")):
        sys.exit(
            f"SLOTGATE_PROFILE={folder!r} holds no profile: make one with python -m"
            f" bench.experiments.pgo {folder}, or leave SLOTGATE_PROFILE unset"
        )
    return [f"-fprofile-use={profile}", "-fprofile-partial-training", "-Wno-missing-profile"]


setup(ext_modules=compiled_modules())
