"""Build and load the small C kernels of kernels/cpu_*.py (shared by every one of them).

Why one module: each CPU kernel is a C source string compiled on first use with the system
compiler and called through ctypes; the cache directory, the cache key (the source, the
flags and the CPU's flags: ``-march=native`` code runs only on a CPU with the same
features), the atomic write (concurrent workers never load a half-written file) and the
opt-outs (``RADIXSERVE_CPU_KERNELS=0``, no compiler, a failed build: the caller gets None
and keeps its torch path) must be the same for all of them.

``~/.cache/radixserve/kernels`` holds the libraries; ``RADIXSERVE_KERNEL_CACHE`` moves it;
``CC`` picks the compiler (else ``cc``, else ``gcc``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

# exp of 8 float lanes already clamped to [-87.34, 88.38], for AVX2/FMA C kernels (each adds
# its own handling of the range ends): n = round(x log2 e), r = x - n ln2 (ln2 in two
# parts), Cephes' expf polynomial, times 2^n built in the exponent bits; ~1 ulp. One copy so
# that the softmax (cpu_extend_attention) and silu (cpu_elementwise) round alike.
AVX2_EXP8_CORE = r"""
static inline __m256 exp8_core(__m256 x) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
"""

# The same exp on 16 lanes for the AVX-512 variants (the same constants and steps, so both
# widths round alike).
AVX512_EXP16_CORE = r"""
static inline __m512 exp16_core(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
"""

# -fno-math-errno only drops errno writes; nothing here reorders float arithmetic.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"]


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
    """``GenuineIntel``, ``AuthenticAMD``, ... ("" where /proc/cpuinfo does not say): where
    oneDNN overtakes a kernel differs between vendors of the same vector width."""
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
    """The built library, or None (logged to `logger`) when disabled, without a compiler
    or when the build fails. `what` names the kernel in the log lines."""
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
