"""ipc sockets live in a private per-user folder (0700); a folder others can write to, or a
symlink/file in its place, is refused."""

import os
import stat

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.internal.v1 import engine_pb2
from services.common import transport


@pytest.fixture
def tmp_root(tmp_path, monkeypatch):
    monkeypatch.setattr(transport.tempfile, "gettempdir", lambda: str(tmp_path))
    return tmp_path


def test_folder_is_created_private(tmp_root):
    addr = transport.new_ipc_addr("worker")
    folder = tmp_root / f"radixserve-{os.getuid()}"
    assert addr.startswith(f"ipc://{folder}/worker-")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_world_writable_folder_is_refused(tmp_root):
    folder = tmp_root / f"radixserve-{os.getuid()}"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match="open to other users"):
        transport.new_ipc_addr("worker")


def test_symlink_in_its_place_is_refused(tmp_root):
    target = tmp_root / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_root / f"radixserve-{os.getuid()}").symlink_to(target)
    with pytest.raises(PermissionError, match="not a directory owned"):
        transport.new_ipc_addr("worker")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_any_bytes_decode_to_a_message_or_bad_frame(payload):
    """decode never raises anything but BadFrame, whatever a peer sends."""
    for cls in (engine_pb2.SchedulerToWorker, engine_pb2.FrontendToScheduler):
        try:
            transport.decode(cls, payload)
        except transport.BadFrame:
            pass


def test_drop_log_counts_every_frame_and_logs_rarely(caplog):
    drops = transport.DropLog("test socket", every_s=60)
    with caplog.at_level("WARNING"):
        for i in range(50):
            drops.note(f"junk {i}")
    assert drops.dropped == 50
    assert len([r for r in caplog.records if "test socket" in r.getMessage()]) == 1
