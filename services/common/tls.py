"""TLS credentials of the gRPC servers and channels, from the PEM files the flags name.

For the public ports (--ssl-*) and the control gRPC (--control-ssl-*); empty: plaintext.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def server_credentials(
    certfile: str, keyfile: str, client_ca: str = ""
) -> grpc.ServerCredentials | None:
    """TLS with this certificate (None: plaintext); ``client_ca``: clients must present one."""
    if not certfile:
        return None
    return grpc.ssl_server_credentials(
        [(_read(keyfile), _read(certfile))],
        root_certificates=_read(client_ca) if client_ca else None,
        require_client_auth=bool(client_ca),
    )


@dataclass(frozen=True)
class ClientTls:
    """How a client dials a TLS server: the CA and, when the certificate's name is not the
    target's host (engines found by DNS are dialed by IP), the name to check instead."""

    credentials: grpc.ChannelCredentials
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, ca_certs: str, server_name: str = "") -> ClientTls | None:
        """None (plaintext) without ``ca_certs``."""
        if not ca_certs:
            return None
        name = (("grpc.ssl_target_name_override", server_name),) if server_name else ()
        return cls(grpc.ssl_channel_credentials(_read(ca_certs)), name)
