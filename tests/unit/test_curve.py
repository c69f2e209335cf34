"""The internal links' keys (services/common/curve.py), in one process: generated and
seed-derived keys, the ZAP allow-list, the tcp:// refusal, serve's ephemeral keys."""

from __future__ import annotations

import os
import shutil
import stat
import time

import pytest
import zmq

from services.common import transport
from services.common.curve import (
    InsecureLink,
    InternalKeys,
    check_link,
    connect_securely,
    ephemeral_keys,
    generate_keys,
    load_keys,
    serve_securely,
)


@pytest.fixture
def keys(tmp_path) -> InternalKeys:
    generate_keys(str(tmp_path / "keys"))
    return InternalKeys(str(tmp_path / "keys"))


def test_generated_keys_are_private_and_consistent(keys):
    folder = keys.folder
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for role in ("frontend", "scheduler", "worker"):
        assert keys.own(role).public == keys.public(role) and len(keys.public(role)) == 40
        assert stat.S_IMODE(os.stat(f"{folder}/{role}.key_secret").st_mode) == 0o600
        assert keys.own(role).secret.decode() not in repr(keys.own(role))
    assert len({keys.public(r) for r in ("frontend", "scheduler", "worker")}) == 3
    assert len(keys.control_token()) == 64


def test_a_seed_derives_the_same_keys_everywhere_and_differs_per_seed(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, seed in ((a, "s" * 64), (b, "t" * 64)):
        folder.mkdir()
        (folder / "seed").write_text(seed + "\n")
    ka, kb = InternalKeys(str(a)), InternalKeys(str(b))
    assert ka.own("worker") == InternalKeys(str(a)).own("worker")
    assert ka.own("worker").public == zmq.curve_public(ka.own("worker").secret)
    assert ka.public("worker") != kb.public("worker") and ka.control_token() != kb.control_token()
    (b / "seed").write_text("short")
    with pytest.raises(ValueError, match="too short"):
        kb.own("worker")


def _pair(ctx, keys, server_role, client_role, allowed, addr):
    setup, peers = serve_securely(ctx, keys, server_role, allowed)
    server = transport.router(ctx, addr, setup=setup)
    client = transport.dealer(
        zmq.Context.instance(), addr, setup=connect_securely(keys, client_role, server_role)
    )
    return server, client, peers


def test_only_configured_peers_get_frames_through(keys, tmp_path):
    ctx = zmq.Context()
    try:
        addr = f"ipc://{tmp_path}/w.sock"
        server, good, peers = _pair(ctx, keys, "worker", "scheduler", ["scheduler"], addr)
        good.send(b"hello")
        assert server.poll(5000) and server.recv_multipart()[1] == b"hello"
        bad = transport.dealer(
            zmq.Context.instance(), addr, setup=connect_securely(keys, "frontend", "worker")
        )
        bad.send(b"intruder")
        deadline = time.monotonic() + 5
        while peers.denied == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert peers.denied >= 1 and not server.poll(300)
        good.send(b"still here")
        assert server.poll(5000) and server.recv_multipart()[1] == b"still here"
        for s in (good, bad, server):
            s.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_tcp_needs_keys_or_the_insecure_flag(keys):
    with pytest.raises(InsecureLink, match="--insecure-internal"):
        check_link("tcp://10.0.0.1:30100", None, False, "--scheduler-addr")
    check_link("tcp://10.0.0.1:30100", None, True, "--scheduler-addr")
    check_link("tcp://10.0.0.1:30100", keys, False, "--scheduler-addr")
    check_link("ipc:///tmp/radixserve-0/s.sock", None, False, "--scheduler-addr")
    assert load_keys("") is None
    with pytest.raises(FileNotFoundError, match="--internal-keys-dir"):
        load_keys("/nonexistent/keys")


def test_serve_makes_keys_only_for_its_own_tcp_links():
    assert ephemeral_keys(["ipc:///x", ""], "", False) is None
    assert ephemeral_keys(["tcp://127.0.0.1:1"], "/given", False) is None
    assert ephemeral_keys(["tcp://127.0.0.1:1"], "", True) is None
    folder = ephemeral_keys(["tcp://127.0.0.1:1", ""], "", False)
    assert folder is not None
    try:
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert InternalKeys(folder).control_token()
    finally:
        shutil.rmtree(folder)
