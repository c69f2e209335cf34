"""Who may talk on the internal links: ZeroMQ CURVE keys and the control token.

``--internal-keys-dir`` holds each role's zmq certificate pair plus ``control.token``, or one
``seed`` (the Helm chart's: Helm cannot compute a CURVE public key) they all derive from by
HMAC-SHA256. With keys, links are encrypted and a ZAP handler admits only the expected peers'
keys; without, ipc:// links stay unauthenticated and tcp:// needs --insecure-internal.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

log = logging.getLogger(__name__)

ROLES = ("frontend", "scheduler", "worker")
CONTROL_TOKEN_FILE = "control.token"
SEED_FILE = "seed"
ZAP_DOMAIN = "radixserve"

SocketSetup = Callable[[zmq.Socket], None]


class InsecureLink(ValueError):
    """A tcp:// internal link without keys and without --insecure-internal."""


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 characters
    secret: bytes = field(repr=False)


@dataclass(frozen=True)
class InternalKeys:
    """The keys in one folder (files, or derived from its seed)."""

    folder: str

    def _seed(self) -> bytes | None:
        path = os.path.join(self.folder, SEED_FILE)
        if not os.path.exists(path):
            return None
        with open(path, "rb") as f:
            seed = f.read().strip()
        if len(seed) < 16:
            raise ValueError(f"{path}: a seed of {len(seed)} bytes is too short (at least 16)")
        return seed

    def own(self, role: str) -> KeyPair:
        """``role``'s keypair (its secret key must be here)."""
        seed = self._seed()
        if seed is not None:
            derived = z85.encode(hmac.new(seed, f"curve/{role}".encode(), hashlib.sha256).digest())
            return KeyPair(zmq.curve_public(derived), derived)
        path = os.path.join(self.folder, f"{role}.key_secret")
        public, secret = zmq.auth.load_certificate(path)
        if not secret:
            raise ValueError(f"{path} holds no secret key")
        return KeyPair(public, secret)

    def public(self, role: str) -> bytes:
        if self._seed() is not None:
            return self.own(role).public
        public, _ = zmq.auth.load_certificate(os.path.join(self.folder, f"{role}.key"))
        return public

    def control_token(self) -> str:
        seed = self._seed()
        if seed is not None:
            return hmac.new(seed, b"control-token", hashlib.sha256).hexdigest()
        with open(os.path.join(self.folder, CONTROL_TOKEN_FILE)) as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"{self.folder}/{CONTROL_TOKEN_FILE} is empty")
        return token


def load_keys(folder: str) -> InternalKeys | None:
    """The keys of ``--internal-keys-dir`` (None when not given)."""
    if not folder:
        return None
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--internal-keys-dir {folder}: no such folder")
    return InternalKeys(folder)


def generate_keys(folder: str) -> None:
    """Writes the three keypairs and a control token (secrets readable by the owner only)."""
    os.makedirs(folder, mode=0o700, exist_ok=True)
    for role in ROLES:
        _, secret_file = zmq.auth.create_certificates(folder, role)
        os.chmod(secret_file, 0o600)
    token_file = os.path.join(folder, CONTROL_TOKEN_FILE)
    fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


def check_link(addr: str, keys: InternalKeys | None, insecure: bool, flag: str) -> None:
    """Refuses a tcp:// link that nothing authenticates (see the module's docstring)."""
    if keys is None and addr.startswith("tcp://") and not insecure:
        raise InsecureLink(
            f"{flag} {addr} is tcp:// but no --internal-keys-dir is given: anyone who reaches "
            "the port could send frames. Give --internal-keys-dir (made by `radixserve keys "
            "generate DIR`), or --insecure-internal on a network you trust."
        )


class AllowedPeers:
    """ZAP credentials provider: admits only the listed keys; logs refusals once per ``every_s``."""

    def __init__(self, allowed: Iterable[bytes], name: str, every_s: float = 10.0) -> None:
        self.allowed = frozenset(allowed)
        self.name, self.every_s = name, every_s
        self.denied = 0
        self._last_log = -float("inf")

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        self.denied += 1
        if time.monotonic() - self._last_log >= self.every_s:
            self._last_log = time.monotonic()
            log.warning(
                "%s: refused a peer whose CURVE key is not configured (%d so far)",
                self.name,
                self.denied,
            )
        return False


def serve_securely(
    ctx: zmq.Context, keys: InternalKeys | None, role: str, peers: Iterable[str]
) -> tuple[SocketSetup | None, AllowedPeers | None]:
    """For the binding side: sets up ZAP on ``ctx`` admitting ``peers``' keys; returns what
    to apply to the socket before it binds (None, None without keys)."""
    if keys is None:
        return None, None
    allowed = AllowedPeers([keys.public(p) for p in peers], f"{role} ZeroMQ")
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("radixserve.zap"))
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=allowed)
    pair = keys.own(role)

    def setup(sock: zmq.Socket) -> None:
        sock.curve_secretkey = pair.secret
        sock.curve_publickey = pair.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()

    return setup, allowed


def connect_securely(keys: InternalKeys | None, role: str, server: str) -> SocketSetup | None:
    """For the connecting side: ``role``'s keypair, and the key ``server`` must prove."""
    if keys is None:
        return None
    pair, server_key = keys.own(role), keys.public(server)

    def setup(sock: zmq.Socket) -> None:
        sock.curve_secretkey = pair.secret
        sock.curve_publickey = pair.public
        sock.curve_serverkey = server_key

    return setup


def ephemeral_keys(
    addrs: Iterable[str], keys_dir: str, insecure: bool, guard_control: bool = False
) -> str | None:
    """For `radixserve serve`: a fresh key folder (caller removes it) when a link is tcp:// or
    ``guard_control``, unless keys or --insecure-internal were given; else None."""
    needed = guard_control or any(a.startswith("tcp://") for a in addrs)
    if keys_dir or insecure or not needed:
        return None
    folder = tempfile.mkdtemp(prefix="radixserve-keys-")  # 0700, owned by this user
    generate_keys(folder)
    return folder
