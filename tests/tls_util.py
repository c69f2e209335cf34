"""A throwaway PKI for TLS tests: one CA, a server certificate for localhost / 127.0.0.1
and a client certificate, made with the openssl CLI (the venv has no `cryptography`)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _leaf(d: Path, name: str, ext: str) -> tuple[Path, Path]:
    key, csr, cert, extfile = (d / f"{name}.{s}" for s in ("key", "csr", "crt", "ext"))
    extfile.write_text(ext + "\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", key, "-out", csr, "-subj", f"/CN={name}")  # fmt: skip
    _openssl("x509", "-req", "-in", csr, "-CA", d / "ca.crt", "-CAkey", d / "ca.key",
             "-CAcreateserial", "-days", "2", "-out", cert, "-extfile", extfile)  # fmt: skip
    return cert, key


def make_pki(d: Path) -> Pki:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", d / "ca.key", "-out", d / "ca.crt", "-days", "2",
             "-subj", "/CN=radixserve-test-ca",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")  # fmt: skip
    server = _leaf(
        d, "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"
    )
    client = _leaf(d, "client", "extendedKeyUsage=clientAuth")
    return Pki(d / "ca.crt", *server, *client)
