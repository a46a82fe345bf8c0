"""SQLite state: engines, deployments and their revisions, API keys, hosts.

WAL with synchronous=FULL: a write that returned is on disk, so a crash (even
SIGKILL or power loss right after) loses nothing already acknowledged. Every
write is one transaction. The store is synchronous on purpose: each call is a
short local write, cheaper than a thread hop, and one connection per process
keeps ordering simple.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from ..errors import CapyError, Conflict, NotFound
from ..spec import DeploymentSpec, EngineSpec
from ._schema import MIGRATIONS

KEY_PREFIX = "capy-"


@dataclass(frozen=True)
class Revision:
    deployment: str
    revision: int
    spec: DeploymentSpec
    spec_hash: str
    model_commit: str | None
    created_at: float


@dataclass(frozen=True)
class Deployment:
    name: str
    revision: int
    desired: str  # active | parked | stopped
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class Runtime:
    deployment: str
    state: str
    reason: str | None
    host: str
    launch_id: str | None
    port: int | None
    model_path: str | None
    updated_at: float


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    models: frozenset[str] | None  # None: every model
    created_at: float
    revoked_at: float | None


@dataclass(frozen=True)
class Host:
    name: str
    kind: str  # local | ssh
    address: str | None
    port: int | None
    identity: str | None
    created_at: float
    known_hosts: str | None = None  # the known_hosts file an SSH host's key is checked against
    unified_memory: bool | None = None  # GPU and host memory are one pool (None: not declared)


def spec_hash(spec: DeploymentSpec) -> str:
    canonical = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _hash_key(secret: str) -> str:
    # Keys are 256 random bits, so a fast hash is enough: there is nothing to brute-force.
    return hashlib.sha256(secret.encode()).hexdigest()


class Store:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        self._lock = threading.RLock()
        # Bumped whenever this Store creates or revokes an API key: a verifier that caches keys
        # (daemon.StoreKeys) forgets them when it changes.
        self.keys_generation = 0
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=10)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.execute("PRAGMA busy_timeout=10000")
        if str(path) != ":memory:":
            os.chmod(self.path, 0o640)
        self._migrate()

    # -- plumbing ---------------------------------------------------------------------------

    def _migrate(self) -> None:
        with self._tx() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > len(MIGRATIONS):
                raise RuntimeError(
                    f"{self.path} has schema version {version}, newer than this CapyCTL knows "
                    f"({len(MIGRATIONS)}); upgrade CapyCTL or restore a backup")
            for number, script in enumerate(MIGRATIONS[version:], start=version + 1):
                for statement in script.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute(f"PRAGMA user_version={number}")

    @property
    def schema_version(self) -> int:
        return self._db.execute("PRAGMA user_version").fetchone()[0]

    def _tx(self):
        store = self

        class _Tx:
            def __enter__(self) -> sqlite3.Connection:
                store._lock.acquire()
                store._db.execute("BEGIN IMMEDIATE")
                return store._db

            def __exit__(self, exc_type, exc, tb) -> None:
                try:
                    store._db.execute("COMMIT" if exc_type is None else "ROLLBACK")
                finally:
                    store._lock.release()

        return _Tx()

    def _rows(self, sql: str, *args) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def backup(self, target: str | Path) -> None:
        """A consistent copy while the daemon runs (SQLite's online backup)."""
        dest = sqlite3.connect(str(target))
        with self._lock:
            self._db.backup(dest)
        dest.close()

    # -- engines ----------------------------------------------------------------------------

    def put_engine(self, spec: EngineSpec, *, replace: bool = False) -> None:
        with self._tx() as db:
            exists = db.execute("SELECT 1 FROM engines WHERE name=?", (spec.name,)).fetchone()
            if exists and not replace:
                raise Conflict(f"an engine named {spec.name!r} is already registered; remove it first",
                               code="engine_exists")
            db.execute("INSERT OR REPLACE INTO engines(name, type, spec_json, created_at) VALUES (?,?,?,?)",
                       (spec.name, spec.type, spec.model_dump_json(), time.time()))

    def get_engine(self, name: str) -> EngineSpec | None:
        rows = self._rows("SELECT name, spec_json FROM engines WHERE name=?", name)
        return _engine_from_row(rows[0]) if rows else None

    def list_engines(self) -> list[EngineSpec]:
        return [_engine_from_row(r) for r in self._rows("SELECT name, spec_json FROM engines ORDER BY name")]

    def remove_engine(self, name: str) -> None:
        with self._tx() as db:
            users = [r["deployment"] for r in db.execute(
                "SELECT r.deployment, r.spec_json FROM revisions r JOIN deployments d "
                "ON d.name=r.deployment AND d.revision=r.revision").fetchall()
                if json.loads(r["spec_json"]).get("engine") == name]
            if users:
                raise Conflict(f"engine {name!r} is used by deployment(s) {', '.join(users)}",
                               code="engine_in_use")
            if db.execute("DELETE FROM engines WHERE name=?", (name,)).rowcount == 0:
                raise NotFound(f"no engine named {name!r}", code="engine_not_found")

    # -- deployments ------------------------------------------------------------------------

    def put_deployment(self, spec: DeploymentSpec, *, model_commit: str | None = None,
                       desired: str = "active") -> tuple[Revision, bool]:
        """Record a deploy. A changed manifest becomes a new revision; the same one is not
        duplicated. Returns the current revision and whether it is new."""
        digest = spec_hash(spec)
        now = time.time()
        with self._tx() as db:
            row = db.execute("SELECT revision FROM deployments WHERE name=?", (spec.name,)).fetchone()
            if row:
                current = db.execute("SELECT * FROM revisions WHERE deployment=? AND revision=?",
                                     (spec.name, row["revision"])).fetchone()
                if current["spec_hash"] == digest and (model_commit is None
                                                       or current["model_commit"] == model_commit):
                    db.execute("UPDATE deployments SET desired=?, updated_at=? WHERE name=?",
                               (desired, now, spec.name))
                    return self._revision(current), False
                number = db.execute("SELECT MAX(revision) FROM revisions WHERE deployment=?",
                                    (spec.name,)).fetchone()[0] + 1
                db.execute("UPDATE deployments SET revision=?, desired=?, updated_at=? WHERE name=?",
                           (number, desired, now, spec.name))
            else:
                number = 1
                db.execute("INSERT INTO deployments(name, revision, desired, created_at, updated_at) "
                           "VALUES (?,?,?,?,?)", (spec.name, number, desired, now, now))
            db.execute("INSERT INTO revisions(deployment, revision, spec_json, spec_hash, model_commit, "
                       "created_at) VALUES (?,?,?,?,?,?)",
                       (spec.name, number, spec.model_dump_json(), digest, model_commit, now))
        return Revision(spec.name, number, spec, digest, model_commit, now), True

    @staticmethod
    def _revision(row: sqlite3.Row) -> Revision:
        return Revision(row["deployment"], row["revision"], DeploymentSpec.model_validate_json(row["spec_json"]),
                        row["spec_hash"], row["model_commit"], row["created_at"])

    def get_deployment(self, name: str) -> Deployment | None:
        rows = self._rows("SELECT * FROM deployments WHERE name=?", name)
        return Deployment(**dict(rows[0])) if rows else None

    def list_deployments(self) -> list[Deployment]:
        return [Deployment(**dict(r)) for r in self._rows("SELECT * FROM deployments ORDER BY name")]

    def current_revision(self, name: str) -> Revision | None:
        rows = self._rows("SELECT r.* FROM revisions r JOIN deployments d ON d.name=r.deployment "
                          "AND d.revision=r.revision WHERE d.name=?", name)
        return self._revision(rows[0]) if rows else None

    def revisions(self, name: str) -> list[Revision]:
        return [self._revision(r) for r in
                self._rows("SELECT * FROM revisions WHERE deployment=? ORDER BY revision", name)]

    def set_desired(self, name: str, desired: str) -> None:
        with self._tx() as db:
            if db.execute("UPDATE deployments SET desired=?, updated_at=? WHERE name=?",
                          (desired, time.time(), name)).rowcount == 0:
                raise NotFound(f"no deployment named {name!r}", code="deployment_not_found")

    def delete_deployment(self, name: str) -> None:
        with self._tx() as db:
            if db.execute("DELETE FROM deployments WHERE name=?", (name,)).rowcount == 0:
                raise NotFound(f"no deployment named {name!r}", code="deployment_not_found")
            db.execute("DELETE FROM revisions WHERE deployment=?", (name,))
            db.execute("DELETE FROM runtime WHERE deployment=?", (name,))

    # -- runtime (what is running where; lets a restarted daemon adopt its units) ------------

    def put_runtime(self, deployment: str, state: str, *, reason: str | None = None, host: str = "local",
                    launch_id: str | None = None, port: int | None = None,
                    model_path: str | None = None) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO runtime(deployment, state, reason, host, launch_id, port, "
                       "model_path, updated_at) VALUES (?,?,?,?,?,?,?,?)",
                       (deployment, state, reason, host, launch_id, port, model_path, time.time()))

    def remove_runtime(self, deployment: str) -> None:
        """Forget what ran for ``deployment`` (a replica the deployment no longer has)."""
        with self._tx() as db:
            db.execute("DELETE FROM runtime WHERE deployment=?", (deployment,))

    def get_runtime(self, deployment: str) -> Runtime | None:
        rows = self._rows("SELECT * FROM runtime WHERE deployment=?", deployment)
        return Runtime(**dict(rows[0])) if rows else None

    # -- API keys ---------------------------------------------------------------------------

    def create_key(self, name: str, models: list[str] | None = None) -> tuple[ApiKey, str]:
        """Returns the record and the secret, which is shown once and stored only hashed."""
        key_id = secrets.token_hex(4)
        secret = f"{KEY_PREFIX}{key_id}-{secrets.token_urlsafe(32)}"
        now = time.time()
        with self._tx() as db:
            db.execute("INSERT INTO api_keys(id, name, hash, models_json, created_at) VALUES (?,?,?,?,?)",
                       (key_id, name, _hash_key(secret), json.dumps(sorted(models)) if models else None, now))
        self.keys_generation += 1
        return ApiKey(key_id, name, frozenset(models) if models else None, now, None), secret

    def _key(self, row: sqlite3.Row) -> ApiKey:
        models = json.loads(row["models_json"]) if row["models_json"] else None
        return ApiKey(row["id"], row["name"], frozenset(models) if models else None,
                      row["created_at"], row["revoked_at"])

    def list_keys(self) -> list[ApiKey]:
        return [self._key(r) for r in self._rows("SELECT * FROM api_keys ORDER BY created_at")]

    def revoke_key(self, key_id_or_name: str) -> ApiKey:
        with self._tx() as db:
            rows = db.execute("SELECT * FROM api_keys WHERE (id=? OR name=?) AND revoked_at IS NULL",
                              (key_id_or_name, key_id_or_name)).fetchall()
            if not rows:
                raise NotFound(f"no active API key with id or name {key_id_or_name!r}", code="key_not_found")
            if len(rows) > 1:
                raise Conflict(f"{len(rows)} keys are named {key_id_or_name!r}; revoke one by its id",
                               code="key_ambiguous")
            db.execute("UPDATE api_keys SET revoked_at=? WHERE id=?", (time.time(), rows[0]["id"]))
        self.keys_generation += 1
        return self._key(rows[0])

    def verify_key(self, secret: str) -> ApiKey | None:
        """The key's record if ``secret`` is a live key; constant-time on the hash."""
        # Keys are ASCII; anything else (a header with bytes that are not UTF-8 reaches us with
        # lone surrogates) is no key, and could not even be hashed or queried.
        if not secret.startswith(KEY_PREFIX) or not secret.isascii():
            return None
        key_id = secret[len(KEY_PREFIX):].split("-", 1)[0]
        rows = self._rows("SELECT * FROM api_keys WHERE id=? AND revoked_at IS NULL", key_id)
        if not rows:
            # Compare anyway so a missing id takes as long as a wrong secret.
            hmac.compare_digest(_hash_key(secret), "0" * 64)
            return None
        if hmac.compare_digest(_hash_key(secret), rows[0]["hash"]):
            return self._key(rows[0])
        return None

    # -- hosts ------------------------------------------------------------------------------

    def put_host(self, name: str, kind: str, *, address: str | None = None, port: int | None = None,
                 identity: str | None = None, known_hosts: str | None = None,
                 unified_memory: bool | None = None) -> Host:
        now = time.time()
        with self._tx() as db:
            if db.execute("SELECT 1 FROM hosts WHERE name=?", (name,)).fetchone():
                raise Conflict(f"a host named {name!r} exists already", code="host_exists")
            db.execute("INSERT INTO hosts(name, kind, address, port, identity, created_at, known_hosts, "
                       "unified_memory) VALUES (?,?,?,?,?,?,?,?)",
                       (name, kind, address, port, identity, now, known_hosts,
                        None if unified_memory is None else int(unified_memory)))
        return Host(name, kind, address, port, identity, now, known_hosts, unified_memory)

    def list_hosts(self) -> list[Host]:
        hosts = []
        for row in self._rows("SELECT * FROM hosts ORDER BY name"):
            fields = dict(row)
            if fields.get("unified_memory") is not None:
                fields["unified_memory"] = bool(fields["unified_memory"])
            hosts.append(Host(**fields))
        return hosts

    def put_host_inventory(self, host: str, info: dict) -> None:
        """Record the inventory just read from ``host`` (the one its next start begins with)."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO host_inventories(host, info_json, read_at) VALUES (?,?,?)",
                       (host, json.dumps(info), time.time()))

    def host_inventory(self, host: str) -> tuple[dict, float] | None:
        """The last inventory read from ``host`` and when, or None."""
        rows = self._rows("SELECT info_json, read_at FROM host_inventories WHERE host=?", host)
        return (json.loads(rows[0]["info_json"]), rows[0]["read_at"]) if rows else None

    # -- park records (tier reached, wake seconds, proof after wake) ----------------------------

    def put_park_record(self, deployment: str, record: dict) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO park_records(deployment, record_json, updated_at) VALUES (?,?,?)",
                       (deployment, json.dumps(record), time.time()))

    def park_record(self, deployment: str) -> dict | None:
        rows = self._rows("SELECT record_json FROM park_records WHERE deployment=?", deployment)
        return json.loads(rows[0]["record_json"]) if rows else None

    def remove_park_record(self, deployment: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM park_records WHERE deployment=?", (deployment,))

    def remove_host(self, name: str) -> None:
        with self._tx() as db:
            if db.execute("DELETE FROM hosts WHERE name=?", (name,)).rowcount == 0:
                raise NotFound(f"no host named {name!r}", code="host_not_found")

    # -- cordons (hosts closed to new placements) ---------------------------------------------

    def cordon(self, host: str, reason: str | None = None) -> None:
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO cordons(host, reason, created_at) VALUES (?,?,?)",
                       (host, reason, time.time()))

    def uncordon(self, host: str) -> bool:
        """Whether the host was cordoned."""
        with self._tx() as db:
            return db.execute("DELETE FROM cordons WHERE host=?", (host,)).rowcount > 0

    def cordons(self) -> dict[str, float]:
        """Cordoned host -> when it was cordoned."""
        return {r["host"]: r["created_at"] for r in self._rows("SELECT host, created_at FROM cordons")}

    # -- idempotency (management API's Idempotency-Key) ---------------------------------------

    def idempotent_response(self, key: str) -> dict | None:
        rows = self._rows("SELECT response FROM idempotency WHERE key=?", key)
        return json.loads(rows[0]["response"]) if rows else None

    def remember_response(self, key: str, response: dict) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO idempotency(key, response, created_at) VALUES (?,?,?)",
                       (key, json.dumps(response), time.time()))
            # A day is plenty for a client to retry; keep the table small.
            db.execute("DELETE FROM idempotency WHERE created_at < ?", (time.time() - 86400,))


def _engine_from_row(row) -> EngineSpec:
    """A stored registration; one that an older CapyCTL accepted and this one refuses (a custom
    cmd with {key}) is a clear error naming it, not a crash."""
    try:
        return EngineSpec.model_validate_json(row["spec_json"])
    except ValidationError as exc:
        reason = exc.errors()[0].get("msg", str(exc)) if exc.errors() else str(exc)
        raise CapyError(f"the registration of engine {row['name']!r} is no longer valid ({reason}); "
                        f"remove it with 'capyctl engine remove' and register it again",
                        code="engine_registration_invalid", status=409) from None
