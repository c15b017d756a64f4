"""Compiles the CPU attention kernels on first use and registers them as
``torch.ops.tessera_cpu.*``.

They are built on the machine that runs them (torch's extension builder,
cached under ``TORCH_EXTENSIONS_DIR``), with ``-march=native``. The build is
named after a hash of this CPU's instruction-set flags, the sources, the
compiler flags and the torch and Python versions: a cache shared with another
kind of CPU never loads code that machine cannot run, and a build that exists
under its name is current, so later starts load it directly (a millisecond,
against about two seconds for the builder's own up-to-date check).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(name) for name in (
    "paged_decode.cpp", "prefill_attention.cpp", "fused_layers.cpp", "linear_f32.cpp", "lora_rows.cpp",
))
# Included by the sources: part of the build's name, so a change rebuilds.
HEADERS = (Path(__file__).with_name("bf16_bits.h"),)
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def extension_name() -> str:
    key = hashlib.sha256()
    for part in (_cpu_flags(), " ".join(CFLAGS), torch.__version__, sys.version):
        key.update(part.encode() + b"\0")
    for source in SOURCES + HEADERS:
        key.update(source.read_bytes())
    return f"tessera_cpu_ops_{key.hexdigest()[:16]}"


def build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / name


@functools.cache
def load_cpu_ops() -> str | None:
    """Loads the ops, building them first if this machine has no current
    build; None on success, else why they cannot run."""
    name = extension_name()
    directory = build_directory(name)
    library = directory / f"{name}.so"
    try:
        if library.is_file():
            try:
                torch.ops.load_library(str(library))
                return None
            except OSError:
                pass  # another engine may be linking it right now: the build below waits on its lock
        _build(name, directory)
        torch.ops.load_library(str(library))
    except Exception as exc:  # a failed build is a reason to fall back, not a crash
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        return f"building the CPU attention kernels failed: {lines[-1][:300]}"
    return None


def _build(name: str, directory: Path) -> None:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise RuntimeError("no C++ compiler (c++/g++) on PATH")
    _put_ninja_on_path()
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    logger.info("building the CPU attention kernels in %s (once per machine and version)", directory)
    # The builder locks the directory, so engines starting together build once.
    load(
        name=name, sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS), build_directory=str(directory),
        is_python_module=False, verbose=False,
    )


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the ninja wheel (a dependency)
    installs it next to the interpreter, which is not on PATH when the venv
    is not activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
