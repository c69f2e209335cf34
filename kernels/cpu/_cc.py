"""Build and load the C kernels of kernels/cpu/, the same way for all of them.

Compiled on first use, cached by source, flags and CPU flags, written atomically, loaded
through ctypes; ``RADIXSERVE_CPU_KERNELS=0``, no compiler or a failed build: None (the caller
keeps torch). ``RADIXSERVE_CPU_ISA`` builds narrower than the CPU (kernels/README.md).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# What RADIXSERVE_CPU_ISA takes off -march=native (gcc drops what depends on it too).
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "native": (),
    "avx512": ("-mno-avx512bf16", "-mno-avx512fp16"),
    "avx2": ("-mno-avx512f",),
    "c": ("-mno-avx2", "-mno-fma"),
}


def isa_flags() -> tuple[str, ...]:
    """The flags of RADIXSERVE_CPU_ISA (unset: native); ValueError names a wrong value."""
    name = os.environ.get("RADIXSERVE_CPU_ISA", "native") or "native"
    if name not in ISA_FLAGS:
        raise ValueError(f"RADIXSERVE_CPU_ISA must be one of {', '.join(ISA_FLAGS)}, got {name!r}")
    return ISA_FLAGS[name]


# -fno-math-errno only drops errno writes; nothing here reorders float arithmetic.
FLAGS = ["-O3", "-march=native", *isa_flags(), "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]

# The element types the kernels take (kernels/cpu/half.h's DT_* codes).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# A line ``#include "name.h"``: a header of kernels/cpu/, pasted in by read_source.
_LOCAL_INCLUDE = re.compile(r'^#include "([\w.]+)"$', re.MULTILINE)


def read_source(name: str, **defines: int) -> str:
    """kernels/cpu/<name> with local headers pasted in and ``defines`` prepended: one text, so
    the cache key sees every line compiled. Package data, so an installed wheel has it too."""
    folder = resources.files("kernels.cpu")

    def paste(match: re.Match[str]) -> str:
        return (folder / match.group(1)).read_text().rstrip("\n")

    text = _LOCAL_INCLUDE.sub(paste, (folder / name).read_text())
    head = "".join(f"#define {key} {value}\n" for key, value in defines.items())
    return head + text


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "radixserve" / "kernels"
    return Path(os.environ.get("RADIXSERVE_KERNEL_CACHE") or default)


def cpu_flags() -> str:
    """-march=native code runs only on a CPU with the same features: part of the key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@functools.cache
def cpu_vendor() -> str:
    """``GenuineIntel``, ``AuthenticAMD``, ... or "": where oneDNN overtakes a kernel varies."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def disabled() -> bool:
    return os.environ.get("RADIXSERVE_CPU_KERNELS", "1") == "0"


def build(name: str, source: str, flags: list[str], cc: str) -> Path:
    """``<cache>/<name>_<key>.so``, compiled unless a library of that key is there."""
    key = hashlib.sha256("\n".join([source, *flags, cpu_flags()]).encode()).hexdigest()[:16]
    lib = cache_dir() / f"{name}_{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, out = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        subprocess.run(
            [cc, *flags, str(src), "-o", str(out), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(out, lib)  # atomic: another worker sees the whole file or none
    return lib


def load_library(
    name: str, source: str, what: str, logger: logging.Logger = log, flags: list[str] = FLAGS
) -> ctypes.CDLL | None:
    """The built library, or None (logged, naming `what`): disabled, no compiler, failed build."""
    if disabled():
        return None
    cc = compiler()
    if cc is None:
        logger.info("no C compiler: %s stays on the torch path", what)
        return None
    try:
        return ctypes.CDLL(str(build(name, source, flags, cc)))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("%s kernel not built (%s); using the torch path", what, e)
        return None
