"""The SQLite store: revisions, keys, migrations, and nothing acknowledged lost on a crash."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys

import pytest

from capyctl.errors import Conflict, NotFound
from capyctl.spec import parse_manifest
from capyctl.store import Store
from capyctl.store._schema import MIGRATIONS

MANIFEST = "name: smol\nengine: llama.cpp\nmodel: {path: /m.gguf}\n"


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "state.db")
    yield s
    s.close()


def test_a_changed_manifest_is_a_new_revision(store):
    spec = parse_manifest(MANIFEST)
    rev, new = store.put_deployment(spec)
    assert (rev.revision, new) == (1, True)
    again, new = store.put_deployment(spec)
    assert (again.revision, new) == (1, False)
    changed, new = store.put_deployment(parse_manifest(MANIFEST + "queue: 8\n"))
    assert (changed.revision, new) == (2, True)
    assert store.current_revision("smol").spec.queue == 8
    assert [r.revision for r in store.revisions("smol")] == [1, 2]


def test_delete_and_missing(store):
    store.put_deployment(parse_manifest(MANIFEST))
    store.delete_deployment("smol")
    assert store.get_deployment("smol") is None
    with pytest.raises(NotFound) as info:
        store.delete_deployment("smol")
    assert info.value.code == "deployment_not_found"


def test_keys_are_hashed_scoped_and_revocable(store, tmp_path):
    record, secret = store.create_key("ci", ["smol"])
    assert store.verify_key(secret).models == frozenset({"smol"})
    assert store.verify_key(secret[:-1] + ("A" if secret[-1] != "A" else "B")) is None
    assert store.verify_key("sk-something") is None
    raw = sqlite3.connect(tmp_path / "state.db").execute("SELECT hash FROM api_keys").fetchone()[0]
    assert secret not in raw and len(raw) == 64
    store.revoke_key("ci")
    assert store.verify_key(secret) is None
    with pytest.raises(NotFound):
        store.revoke_key("ci")


def test_engines_in_use_cannot_be_removed(store):
    engine = parse_manifest("kind: engine\nname: llama\ntype: llama.cpp\npath: /usr/bin/llama-server\n")
    store.put_engine(engine)
    with pytest.raises(Conflict):
        store.put_engine(engine)
    store.put_deployment(parse_manifest(MANIFEST.replace("llama.cpp", "llama")))
    with pytest.raises(Conflict) as info:
        store.remove_engine("llama")
    assert info.value.code == "engine_in_use"


def test_schema_is_versioned_and_newer_databases_are_refused(tmp_path):
    path = tmp_path / "state.db"
    Store(path).close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.execute(f"PRAGMA user_version={len(MIGRATIONS) + 1}")
    db.commit()
    db.close()
    with pytest.raises(RuntimeError, match="newer than this CapyCTL knows"):
        Store(path)


WRITER = r"""
import sys
from capyctl.spec import parse_manifest
from capyctl.store import Store
s = Store(sys.argv[1])
i = 0
while True:
    s.put_deployment(parse_manifest(f"name: d{i}\nengine: vllm\nmodel: {{path: /m}}\n"))
    print(i, flush=True)   # acknowledged only after the write returned
    i += 1
"""


def test_sigkill_mid_write_loses_nothing_acknowledged(tmp_path):
    path = tmp_path / "state.db"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True)
    acknowledged = -1
    for line in proc.stdout:
        acknowledged = int(line)
        if acknowledged >= 40:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # Whatever was printed before the kill must be there; later lines may be too.
    store = Store(path)
    names = {d.name for d in store.list_deployments()}
    assert {f"d{i}" for i in range(acknowledged + 1)} <= names
    assert store.current_revision(f"d{acknowledged}").revision == 1


def test_a_stored_registration_this_version_refuses_is_a_clear_error(tmp_path):
    # A custom engine whose cmd had {key} was accepted before keys left the command line.
    import json as _json

    from capyctl.errors import CapyError
    store = Store(tmp_path / "state.db")
    from capyctl.spec import EngineSpec
    good = EngineSpec.model_validate({"kind": "engine", "name": "mine", "type": "custom", "cmd": ["/srv/x", "{port}"]})
    store.put_engine(good)
    old = {**_json.loads(good.model_dump_json()), "cmd": ["/srv/x", "{port}", "--api-key", "{key}"]}
    with store._tx() as db:
        db.execute("UPDATE engines SET spec_json=? WHERE name='mine'", (_json.dumps(old),))
    with pytest.raises(CapyError) as err:
        store.get_engine("mine")
    assert err.value.code == "engine_registration_invalid" and "'mine'" in err.value.message


def test_a_hosts_last_inventory_is_kept_and_goes_with_the_host(store):
    assert store.host_inventory("b") is None
    store.put_host("b", "ssh", address="10.0.0.2")
    store.put_host_inventory("b", {"hostname": "b", "gpus": [], "ram_total": 1 << 30})
    store.put_host_inventory("b", {"hostname": "b", "gpus": [], "ram_total": 2 << 30})
    info, read_at = store.host_inventory("b")
    assert info["ram_total"] == 2 << 30 and read_at > 0
    store.remove_host("b")
    assert store.host_inventory("b") is None
