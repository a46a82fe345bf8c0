"""Schema migrations, applied in order; PRAGMA user_version records how far a database is."""

MIGRATIONS: list[str] = [
    # 1: the first schema
    """
    CREATE TABLE engines (
        name        TEXT PRIMARY KEY,
        type        TEXT NOT NULL,
        spec_json   TEXT NOT NULL,
        created_at  REAL NOT NULL
    );
    CREATE TABLE deployments (
        name        TEXT PRIMARY KEY,
        revision    INTEGER NOT NULL,
        desired     TEXT NOT NULL DEFAULT 'active',
        created_at  REAL NOT NULL,
        updated_at  REAL NOT NULL
    );
    CREATE TABLE revisions (
        deployment  TEXT NOT NULL,
        revision    INTEGER NOT NULL,
        spec_json   TEXT NOT NULL,
        spec_hash   TEXT NOT NULL,
        model_commit TEXT,
        created_at  REAL NOT NULL,
        PRIMARY KEY (deployment, revision)
    );
    CREATE TABLE runtime (
        deployment  TEXT PRIMARY KEY,
        state       TEXT NOT NULL,
        reason      TEXT,
        host        TEXT NOT NULL DEFAULT 'local',
        launch_id   TEXT,
        port        INTEGER,
        model_path  TEXT,
        updated_at  REAL NOT NULL
    );
    CREATE TABLE api_keys (
        id          TEXT PRIMARY KEY,
        name        TEXT NOT NULL,
        hash        TEXT NOT NULL,
        models_json TEXT,
        created_at  REAL NOT NULL,
        revoked_at  REAL
    );
    CREATE TABLE hosts (
        name        TEXT PRIMARY KEY,
        kind        TEXT NOT NULL,
        address     TEXT,
        port        INTEGER,
        identity    TEXT,
        created_at  REAL NOT NULL
    );
    CREATE TABLE idempotency (
        key         TEXT PRIMARY KEY,
        response    TEXT NOT NULL,
        created_at  REAL NOT NULL
    );
    """,
    # 2: SSH hosts keep the known_hosts file their host key is checked against
    """
    ALTER TABLE hosts ADD COLUMN known_hosts TEXT;
    """,
    # 3: hosts closed to new placements (capyctl drain host); "local" included, hence its own table
    """
    CREATE TABLE cordons (
        host        TEXT PRIMARY KEY,
        reason      TEXT,
        created_at  REAL NOT NULL
    );
    """,
    # 4: whether a host's GPU and host memory are one pool (NULL: not declared), and each
    # deployment's park record (tier reached, wake seconds, proof after wake, the proof's reference)
    """
    ALTER TABLE hosts ADD COLUMN unified_memory INTEGER;
    CREATE TABLE park_records (
        deployment  TEXT PRIMARY KEY,
        record_json TEXT NOT NULL,
        updated_at  REAL NOT NULL
    );
    """,
    # 5: each SSH host's last inventory (`capyctl host-info --json`), so that a restart adopts a
    # host's units on its handshake and bus alone and reads the inventory again afterwards
    """
    CREATE TABLE host_inventories (
        host        TEXT PRIMARY KEY REFERENCES hosts(name) ON DELETE CASCADE,
        info_json   TEXT NOT NULL,
        read_at     REAL NOT NULL
    );
    """,
]
