"""State in SQLite: engines, deployments and revisions, runtime, API keys, hosts."""

from ._store import KEY_PREFIX, ApiKey, Deployment, Host, Revision, Runtime, Store, spec_hash

__all__ = ["KEY_PREFIX", "ApiKey", "Deployment", "Host", "Revision", "Runtime", "Store", "spec_hash"]
