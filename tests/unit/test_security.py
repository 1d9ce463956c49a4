"""Per-run CURVE keys, one keypair per party (private files, damaged or mismatched ones, a run from
before per-kind keys), what each process reads, and that authentication is on unless opted out.
(CURVE sockets, fixed-port rebinding and malformed frames: tests/integration/test_curve_sockets.py;
who may send what: tests/integration/test_auth.py.)"""
from __future__ import annotations

import json
import logging
import os
import stat
from types import SimpleNamespace

import pytest
import zmq

from laminar_hpc.transport import security
from laminar_hpc.transport.security import (KEYPAIRS, ClientKeys, KeyFileError, ServerKeys, auth_enabled, client_keys,
                                            ensure_keys, key_file, public_file, server_keys)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def keypair(path) -> tuple[bytes, bytes]:
    data = json.loads(path.read_text())
    return data["public"].encode(), data["secret"].encode()


LOOPBACK = SimpleNamespace(host="127.0.0.1", auth="auto")


# ---------------------------------------------------------------------------------------------
# key files
# ---------------------------------------------------------------------------------------------
def test_ensure_keys_writes_one_private_keypair_per_party_and_keeps_them(tmp_path):
    ensure_keys(tmp_path)
    sdir = tmp_path / "secrets"
    assert mode(sdir) == 0o700
    assert set(KEYPAIRS) == {"controller", "judge", "launcher", "trainer", "rollout", "relay", "shard"}
    names = sorted(p.name for p in sdir.iterdir())
    assert names == sorted([f"curve_{n}.key" for n in KEYPAIRS] + [f"curve_{n}.pub" for n in KEYPAIRS])  # no temp files
    publics = set()
    for name in KEYPAIRS:
        assert mode(key_file(tmp_path, name)) == 0o600 and mode(public_file(tmp_path, name)) == 0o600
        public, secret = keypair(key_file(tmp_path, name))
        assert zmq.curve_public(secret) == public and len(public) == 40
        assert public_file(tmp_path, name).read_bytes() == public + b"\n"  # the public file holds no secret
        publics.add(public)
    assert len(publics) == len(KEYPAIRS)  # distinct keys per party
    before = {p.name: p.read_bytes() for p in sdir.iterdir()}
    # a resumed run keeps its keys, tightens loosened permissions and repairs a public file
    os.chmod(sdir, 0o755)
    os.chmod(key_file(tmp_path, "rollout"), 0o644)
    public_file(tmp_path, "trainer").write_text("x" * 40)
    public_file(tmp_path, "relay").unlink()
    ensure_keys(tmp_path)
    assert {p.name: p.read_bytes() for p in sdir.iterdir()} == before
    assert mode(sdir) == 0o700 and mode(key_file(tmp_path, "rollout")) == 0o600
    # a different run has different keys
    ensure_keys(tmp_path / "other")
    assert keypair(key_file(tmp_path / "other", "controller")) != keypair(key_file(tmp_path, "controller"))


def test_a_run_from_before_per_kind_keys_gets_the_missing_ones(tmp_path):
    """The old layout: one server and one shared client keypair. A resume must still start."""
    sdir = tmp_path / "secrets"
    sdir.mkdir(mode=0o700)
    for old in ("curve_server.key", "curve_client.key"):
        public, secret = zmq.curve_keypair()
        (sdir / old).write_text(json.dumps({"public": public.decode(), "secret": secret.decode()}) + "\n")
        os.chmod(sdir / old, 0o600)
    ensure_keys(tmp_path)
    keys = server_keys(tmp_path, "controller", LOOPBACK)
    assert keys is not None and set(keys.clients.values()) == {"launcher", "trainer", "rollout", "relay", "shard", "judge"}
    assert client_keys(tmp_path, "rollout", LOOPBACK).server_public == keys.public


def test_keys_of_each_process_hold_only_its_own_secret(tmp_path):
    ensure_keys(tmp_path)
    ctl = server_keys(tmp_path, "controller")
    assert isinstance(ctl, ServerKeys) and (ctl.public, ctl.secret) == keypair(key_file(tmp_path, "controller"))
    assert ctl.clients == {keypair(key_file(tmp_path, k))[0]: k for k in ("launcher", "trainer", "rollout", "relay", "shard", "judge")}
    handoff = server_keys(tmp_path, "relay")
    assert (handoff.public, handoff.secret) == keypair(key_file(tmp_path, "relay"))
    assert handoff.clients == {keypair(key_file(tmp_path, "trainer"))[0]: "trainer"}  # the trainer only
    ro = client_keys(tmp_path, "rollout")
    assert isinstance(ro, ClientKeys) and (ro.public, ro.secret) == keypair(key_file(tmp_path, "rollout"))
    assert ro.server_public == ctl.public
    assert client_keys(tmp_path, "trainer", server="relay").server_public == handoff.public
    for keys in (ctl, ro):
        assert keys.secret.decode() not in repr(keys)  # secrets stay out of logs
    # each reads only its own secret: with every other key file gone, it still loads
    for name in KEYPAIRS:
        if name != "rollout":
            key_file(tmp_path, name).unlink()
    assert client_keys(tmp_path, "rollout") == ro
    with pytest.raises(KeyFileError, match="curve_controller.key"):
        server_keys(tmp_path, "controller")


def test_a_server_reads_only_public_keys_of_its_clients(tmp_path):
    ensure_keys(tmp_path)
    ctl = server_keys(tmp_path, "controller")
    for kind in ("launcher", "trainer", "rollout", "relay"):
        key_file(tmp_path, kind).unlink()
    assert server_keys(tmp_path, "controller") == ctl


def test_missing_keys_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(KeyFileError, match="curve_rollout.key") as err:
        client_keys(tmp_path, "rollout", LOOPBACK)
    assert "ensure_keys" in str(err.value)
    ensure_keys(tmp_path)
    public_file(tmp_path, "controller").unlink()
    with pytest.raises(KeyFileError, match="curve_controller.pub"):
        client_keys(tmp_path, "rollout", LOOPBACK)
    with pytest.raises(ValueError, match="controller"):
        client_keys(tmp_path, "controller")  # not a client kind
    with pytest.raises(ValueError, match="rollout"):
        server_keys(tmp_path, "rollout")  # not a server


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"public": 5, "secret": 6}',
                                     json.dumps({"public": "x" * 40, "secret": "y" * 40})])
def test_damaged_key_files_are_refused_naming_them(tmp_path, content):
    ensure_keys(tmp_path)
    key_file(tmp_path, "trainer").write_text(content)
    with pytest.raises(KeyFileError, match="curve_trainer.key"):
        client_keys(tmp_path, "trainer")


@pytest.mark.parametrize("content", ["", "short", "~" * 40, "x" * 41])
def test_damaged_public_files_are_refused_naming_them(tmp_path, content):
    ensure_keys(tmp_path)
    public_file(tmp_path, "launcher").write_text(content)
    with pytest.raises(KeyFileError, match="curve_launcher.pub"):
        server_keys(tmp_path, "controller")


def test_a_mismatched_pair_is_refused(tmp_path):
    ensure_keys(tmp_path)
    path = key_file(tmp_path, "relay")
    other_public, _ = zmq.curve_keypair()
    path.write_text(json.dumps({"public": other_public.decode(), "secret": keypair(path)[1].decode()}))
    with pytest.raises(KeyFileError, match="mismatched"):
        server_keys(tmp_path, "relay")


# ---------------------------------------------------------------------------------------------
# who authenticates: everyone, on loopback too, unless `auth: none`
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("host,auth,expected", [
    ("127.0.0.1", "auto", True), ("localhost", "auto", True), ("::1", "auto", True), ("10.0.0.5", "auto", True),
    ("127.0.0.1", "curve", True), ("10.0.0.5", "curve", True),
    ("127.0.0.1", "none", False), ("10.0.0.5", "none", False),
])
def test_auth_enabled(host, auth, expected):
    assert auth_enabled(SimpleNamespace(host=host, auth=auth)) is expected


def test_the_default_config_authenticates_on_loopback():
    from laminar_hpc.config.schema import ControllerCfg
    assert ControllerCfg().host == "127.0.0.1" and auth_enabled(ControllerCfg()) is True
    assert auth_enabled(ControllerCfg(auth="none")) is False


def test_auth_none_runs_unkeyed_and_warns_once(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(security, "_warned_open", False)
    opt_out = SimpleNamespace(host="127.0.0.1", auth="none")
    with caplog.at_level(logging.WARNING, logger=security.__name__):
        assert client_keys(tmp_path, "rollout", opt_out) is None  # no key files needed
        assert server_keys(tmp_path, "controller", opt_out) is None
    warnings = [r for r in caplog.records if r.name == security.__name__]
    assert len(warnings) == 1 and "controller.auth: none" in warnings[0].getMessage()
    assert "every user of this machine" in warnings[0].getMessage()
