"""Per-run CURVE keys (private files, damaged or mismatched ones) and who must authenticate.
(CURVE sockets, fixed-port rebinding and malformed frames: tests/integration/test_curve_sockets.py.)"""
from __future__ import annotations

import json
import os
import stat
from types import SimpleNamespace

import pytest
import zmq

from laminar_hpc.transport.security import (CLIENT_KEY_FILE, SERVER_KEY_FILE, KeyFileError, Keys, auth_enabled,
                                            channel_keys, ensure_keys, load_keys)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def keys(tmp_path) -> Keys:
    return ensure_keys(tmp_path)


# ---------------------------------------------------------------------------------------------
# key files
# ---------------------------------------------------------------------------------------------
def test_ensure_keys_writes_private_files_and_keeps_them(tmp_path):
    keys = ensure_keys(tmp_path)
    sdir = tmp_path / "secrets"
    assert mode(sdir) == 0o700
    for name in (SERVER_KEY_FILE, CLIENT_KEY_FILE):
        assert mode(sdir / name) == 0o600
    assert sorted(p.name for p in sdir.iterdir()) == sorted([SERVER_KEY_FILE, CLIENT_KEY_FILE])  # no temp files
    assert all(len(k) == 40 for k in (keys.server_public, keys.server_secret, keys.client_public,
                                      keys.client_secret))
    assert keys.server_public != keys.client_public
    assert zmq.curve_public(keys.server_secret) == keys.server_public
    assert zmq.curve_public(keys.client_secret) == keys.client_public
    assert "secret" not in repr(keys).replace("secrets=...", "")  # secrets stay out of logs
    # a resumed run keeps its keys (and tightens loosened permissions)
    os.chmod(sdir, 0o755)
    os.chmod(sdir / CLIENT_KEY_FILE, 0o644)
    assert ensure_keys(tmp_path) == keys
    assert load_keys(tmp_path) == keys
    assert mode(sdir) == 0o700 and mode(sdir / CLIENT_KEY_FILE) == 0o600
    # a different run has different keys
    assert ensure_keys(tmp_path / "other") != keys


def test_load_keys_without_keys_names_the_file(tmp_path):
    with pytest.raises(KeyFileError, match=SERVER_KEY_FILE) as err:
        load_keys(tmp_path)
    assert "ensure_keys" in str(err.value)
    ensure_keys(tmp_path)
    (tmp_path / "secrets" / CLIENT_KEY_FILE).unlink()
    with pytest.raises(KeyFileError, match=CLIENT_KEY_FILE):
        load_keys(tmp_path)


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"public": 5, "secret": 6}',
                                     json.dumps({"public": "x" * 40, "secret": "y" * 40})])
def test_load_keys_rejects_damaged_files(tmp_path, content):
    ensure_keys(tmp_path)
    (tmp_path / "secrets" / SERVER_KEY_FILE).write_text(content)
    with pytest.raises(KeyFileError, match=SERVER_KEY_FILE):
        load_keys(tmp_path)


def test_load_keys_rejects_a_mismatched_pair(tmp_path):
    ensure_keys(tmp_path)
    path = tmp_path / "secrets" / CLIENT_KEY_FILE
    other_public, _ = zmq.curve_keypair()
    data = json.loads(path.read_text())
    path.write_text(json.dumps({"public": other_public.decode(), "secret": data["secret"]}))
    with pytest.raises(KeyFileError, match="mismatched"):
        load_keys(tmp_path)


# ---------------------------------------------------------------------------------------------
# who authenticates
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host,auth,expected", [
    ("127.0.0.1", "auto", False), ("127.3.2.1", "auto", False), ("localhost", "auto", False),
    ("::1", "auto", False), ("[::1]", "auto", False), ("::ffff:127.0.0.1", "auto", False),
    ("10.0.0.5", "auto", True), ("0.0.0.0", "auto", True), ("*", "auto", True), ("::", "auto", True),
    ("no-such-host.invalid", "auto", True),
    ("10.0.0.5", "none", False), ("127.0.0.1", "none", False),
    ("127.0.0.1", "curve", True), ("10.0.0.5", "curve", True),
])
def test_auth_enabled(host, auth, expected):
    assert auth_enabled(SimpleNamespace(host=host, auth=auth)) is expected


def test_auth_enabled_reads_controller_cfg():
    from laminar_hpc.config.schema import ControllerCfg
    assert auth_enabled(ControllerCfg()) is False  # loopback by default
    assert auth_enabled(ControllerCfg(host="10.1.2.3")) is True
    assert auth_enabled(ControllerCfg(host="10.1.2.3", auth="none")) is False


def test_channel_keys(tmp_path):
    assert channel_keys(tmp_path, SimpleNamespace(host="127.0.0.1", auth="auto")) is None
    with pytest.raises(KeyFileError):
        channel_keys(tmp_path, SimpleNamespace(host="10.0.0.5", auth="auto"))
    keys = ensure_keys(tmp_path)
    assert channel_keys(tmp_path, SimpleNamespace(host="127.0.0.1", auth="curve")) == keys


# ---------------------------------------------------------------------------------------------
# malformed frames, both directions, with and without CURVE
# ---------------------------------------------------------------------------------------------


    # without keys the ZMTP-signature junk is a (legacy ZMTP 1.0) peer whose empty frame is dropped
