"""A real `redis-server` on a free loopback port, for the storage tier's Redis backend.

    with RedisServer(tmp_path, password="pw") as server:   # waits for PING
        server.url, server.client(), server.kill(), server.start()

No persistence (``--save '' --appendonly no``): a killed server comes back empty. Without
a redis-server binary (``make setup`` installs Debian's) the tests that need one skip and
say why, or fail under CI, where a skipped backend would pass unnoticed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.server_util import free_port


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        why = "redis-server is not installed (make setup installs Debian's redis-server)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return path


class RedisServer:
    def __init__(
        self,
        folder: Path,
        password: str = "",
        maxmemory: str = "",
        tls: tuple[Path, Path, Path] | None = None,  # server cert, its key, the CA
    ):
        self.binary = redis_server_binary()
        self.folder, self.password, self.maxmemory, self.tls = folder, password, maxmemory, tls
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def _argv(self) -> list[str]:
        argv = [self.binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.folder), "--protected-mode", "no"]
        if self.tls:
            cert, key, ca = self.tls
            argv += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert)]
            argv += ["--tls-key-file", str(key), "--tls-ca-cert-file", str(ca)]
            argv += ["--tls-auth-clients", "no"]
        else:
            argv += ["--port", str(self.port)]
        if self.password:
            argv += ["--requirepass", self.password]
        if self.maxmemory:
            argv += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        return argv

    def client(self) -> redis.Redis:
        kw = {"ssl_ca_certs": str(self.tls[2])} if self.tls else {}
        return redis.Redis.from_url(
            self.url, password=self.password or None, socket_timeout=5, **kw
        )

    def start(self, timeout: float = 10.0) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        log = open(self.folder / "redis.log", "ab")  # noqa: SIM115 (the server keeps it)
        self.proc = subprocess.Popen(self._argv(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while True:
                if self.proc.poll() is not None:
                    log_text = (self.folder / "redis.log").read_text(errors="replace")
                    raise RuntimeError(f"redis-server exited ({self.proc.returncode}):\n{log_text}")
                try:
                    if c.ping():
                        return
                except redis.RedisError as e:
                    if time.monotonic() > deadline:
                        self.kill()
                        raise TimeoutError(
                            f"redis-server did not answer PING in {timeout} s"
                        ) from e
                time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: what a crashed or restarted server looks like to its clients."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def make_tls_files(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 it signed (openssl; skip without it)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (needed to make the TLS test's certificates)")
    ca, ca_key = folder / "ca.crt", folder / "ca.key"
    cert, key, csr = folder / "server.crt", folder / "server.key", folder / "server.csr"
    ext = folder / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for cmd in (
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=test-ca"],
        ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "1", "-extfile", ext],
    ):  # fmt: skip
        subprocess.run(["openssl", *map(str, cmd)], check=True, capture_output=True)
    key.chmod(0o644)  # redis-server reads it
    return cert, key, ca
