"""kernels/cpu/_cc.read_source: the C kernels' files become one self-contained text, so the
build cache key (a hash of that text) changes whenever any line the compiler sees does."""

import tomllib
from pathlib import Path

from kernels.cpu import _cc

CPU_DIR = Path(_cc.__file__).parent


def test_headers_are_pasted_in_and_defines_prepended() -> None:
    text = _cc.read_source("extend_attention.c", PARALLEL_MIN=123)
    assert text.startswith("#define PARALLEL_MIN 123\n")
    assert '#include "' not in text
    for header in ("exp8_avx2.h", "exp16_avx512.h"):
        body = (CPU_DIR / header).read_text().rstrip("\n")
        assert body in text


def test_a_header_change_changes_the_source_and_so_the_key(tmp_path, monkeypatch) -> None:
    (tmp_path / "k.c").write_text('#include "h.h"\nint f(void) { return X; }\n')
    header = tmp_path / "h.h"
    header.write_text("#define X 1\n")
    monkeypatch.setattr(_cc.resources, "files", lambda _package: tmp_path)
    before = _cc.read_source("k.c")
    header.write_text("#define X 2\n")
    assert _cc.read_source("k.c") != before


def test_every_c_file_is_package_data() -> None:
    pyproject = tomllib.loads((CPU_DIR.parent.parent / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["kernels.cpu"]
    assert {"*.c", "*.h"} <= set(globs)
    assert {p.suffix for p in CPU_DIR.iterdir() if p.is_file()} <= {".c", ".h", ".py"}
