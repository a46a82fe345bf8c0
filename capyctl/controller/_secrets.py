"""Engine secrets on the host a unit runs on: writes each launch's key and secret files as
systemd credentials (encrypted with systemd-creds where the host can, 0600 files elsewhere),
reads a key back for adoption, and removes them with the launch."""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path

from ..config import Paths
from ..errors import CapyError
from ._hosts import LOCAL, HostRegistry

log = logging.getLogger("capyctl.controller")


class EngineSecrets:
    """The secrets directory of every host (the same path on each), reached through the host registry."""

    def __init__(self, paths: Paths, hosts: HostRegistry) -> None:
        self._paths = paths
        self._hosts = hosts
        # host -> whether systemd-creds encrypts credentials there (None: not tried yet)
        self._sealing: dict[str, bool] = {}
        # (host, deployment) -> its key, unsealed ahead of its adoption (unseal_keys_on)
        self._unsealed: dict[tuple[str, str], str] = {}

    def make_dir(self) -> None:
        """This machine's secrets directory, 0700 (units read it as root through LoadCredential=)."""
        self._paths.secrets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self._paths.secrets_dir, 0o700)

    async def launch_credentials_on(self, host: str, key_file: str, key: str,
                                    files: dict[str, str]) -> tuple[dict[str, str], frozenset[str]]:
        """Write one launch's credentials on the host its unit runs on: the per-launch key (the
        credential KEY_CREDENTIAL, file ``key_file``) and each of ``files`` (LaunchPlan.secret_files:
        credential name -> text). Each is encrypted with ``systemd-creds encrypt`` where the host
        has it (its host key, and its TPM2 where present), so no secret lies in the clear on disk;
        elsewhere it is a 0600 file in the 0700 secrets directory. Returns the credentials for
        TransientUnit (name -> file) and the names that are encrypted."""
        from ..engines import KEY_CREDENTIAL
        wanted = {KEY_CREDENTIAL: (key_file, (key + "\n").encode()),
                  **{name: (name, text.encode()) for name, text in files.items()}}
        credentials: dict[str, str] = {}
        sealed: set[str] = set()
        for credential, (stem, content) in wanted.items():
            path = self._sealed_path(stem)
            if await self._seal_on(host, credential, path, content):
                credentials[credential] = str(path)
                sealed.add(credential)
                # A clear copy from an earlier launch (or version) must not outlive this one.
                await self._remove_files_on(host, [self._secret_path(stem) if stem == key_file
                                                   else self._secret_file_path(stem)])
                continue
            if stem == key_file:
                credentials[credential] = str(await self._write_secret_key_on(host, key_file, key))
            else:
                await self._write_secret_files_on(host, {stem: content.decode()})
                credentials[credential] = str(self._secret_file_path(stem))
        return credentials, frozenset(sealed)

    async def unseal_keys_on(self, host: str, names: list[str]) -> None:
        """Unseal the keys of the deployments ``names`` on ``host`` in one command, for the
        adoptions that follow (``read_secret_key_on`` takes each once; ``forget_unsealed`` drops
        what none took). A restart opened an SSH session a deployment to unseal its key, most of
        what adopting a host's deployments cost. A key that does not unseal here is read the
        usual way."""
        from ..engines import KEY_CREDENTIAL
        if not names:
            return
        # One line a key, in the order given: base64 of what systemd-creds decrypts, empty where it fails.
        script = 'for f do printf "%s\\n" "$(systemd-creds decrypt --name="$0" "$f" - 2>/dev/null | base64 -w0)"; done'
        try:
            rc, out, _ = await self._hosts.run(host, ["sh", "-c", script, KEY_CREDENTIAL,
                                                      *(str(self._sealed_path(n)) for n in names)])
        except (OSError, CapyError):
            return
        lines = out.decode(errors="replace").splitlines()
        if rc != 0 or len(lines) != len(names):
            return
        for name, line in zip(names, lines):
            try:
                key = base64.b64decode(line, validate=True).decode().strip()
            except ValueError:
                continue
            if key:
                self._unsealed[(host, name)] = key

    def forget_unsealed(self, host: str) -> None:
        for entry in [e for e in self._unsealed if e[0] == host]:
            del self._unsealed[entry]

    async def read_secret_key_on(self, host: str, name: str) -> str | None:
        from ..engines import KEY_CREDENTIAL
        unsealed = self._unsealed.pop((host, name), None)
        if unsealed is not None:
            return unsealed
        sealed = self._sealed_path(name)
        if host != LOCAL or sealed.exists():
            key = await self._unseal_on(host, KEY_CREDENTIAL, sealed)
            if key is not None:
                return key
        if host == LOCAL:
            return self._read_secret_key(name)
        text = await self._hosts.read_file(host, self._secret_path(name))
        if text is not None:
            return text.strip() or None
        return _key_of_env_file(await self._hosts.read_file(host, self._legacy_env_path(name)))

    async def remove_secret_key_on(self, host: str, name: str) -> None:
        """The launch's key file (clear, encrypted or a legacy environment file), on the host its
        unit ran on (an offline host keeps it)."""
        await self._remove_files_on(host, [self._secret_path(name), self._legacy_env_path(name),
                                           self._sealed_path(name)])

    async def remove_secret_files_on(self, host: str, names: list[str]) -> None:
        """A launch's secret files, clear or encrypted, on the host its unit ran on."""
        if names:
            await self._remove_files_on(host, [p for n in names for p in (self._secret_file_path(n),
                                                                          self._sealed_path(n))])

    # -- where each file lies, and how it is written, sealed and removed

    def _secret_path(self, name: str) -> Path:
        """The key file a unit loads as its KEY_CREDENTIAL (LoadCredential= reads it as root)."""
        return self._paths.secrets_dir / f"{name}.key"

    def _legacy_env_path(self, name: str) -> Path:
        # Before engine keys were credentials: an EnvironmentFile= with CAPYCTL_ENGINE_KEY=<key>.
        # Still read when adopting a unit an earlier version started, and removed with the key.
        return self._paths.secrets_dir / f"{name}.env"

    def _sealed_path(self, stem: str) -> Path:
        # A credential encrypted by systemd-creds (LoadCredentialEncrypted=); see launch_credentials_on.
        return self._paths.secrets_dir / f"{stem}.cred"

    def _secret_file_path(self, name: str) -> Path:
        """Where a LaunchPlan.secret_files file is written (the source of its credential)."""
        return self._paths.secrets_dir / name

    async def _write_secret_key_on(self, host: str, name: str, key: str) -> Path:
        """The 0600 file with the per-launch key, on the host the unit runs on; the unit loads it
        as a credential, so the key is in no environment file, property or argv."""
        path = self._secret_path(name)
        if host == LOCAL:
            _write_private(path, key + "\n")
        else:
            await self._hosts.write_private_file(host, path, (key + "\n").encode())
        return path

    async def _write_secret_files_on(self, host: str, files: dict[str, str]) -> None:
        """An engine's secret files (SGLang's --config with its key), 0600, on the unit's host."""
        for name, text in files.items():
            path = self._secret_file_path(name)
            if host == LOCAL:
                _write_private(path, text)
            else:
                await self._hosts.write_private_file(host, path, text.encode())

    def _read_secret_key(self, name: str) -> str | None:
        try:
            return self._secret_path(name).read_text().strip() or None
        except FileNotFoundError:
            pass
        try:
            return _key_of_env_file(self._legacy_env_path(name).read_text())
        except FileNotFoundError:
            return None

    async def _seal_on(self, host: str, credential: str, path: Path, content: bytes) -> bool:
        """``systemd-creds encrypt`` of ``content`` into ``path`` on ``host``; False where the host
        cannot (no systemd-creds, systemd older than 250, no writable host key), remembered so the
        next launch does not try again."""
        if self._sealing.get(host) is False:
            return False
        if host == LOCAL:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        argv = ["systemd-creds", "encrypt", f"--name={credential}", "-", str(path)]
        try:
            rc, _, err = await self._hosts.run(host, argv, input=content)
        except (OSError, CapyError) as exc:  # FileNotFoundError: no systemd-creds on this machine
            rc, err = 1, str(exc).encode()
        if rc == 0 and host == LOCAL:
            path.chmod(0o600)
        elif rc == 0:
            rc, _, err = await self._hosts.run(host, ["chmod", "0600", str(path)])
        if rc != 0:
            if self._sealing.get(host) is None:
                log.warning("engine keys on host %s are 0600 files, not encrypted credentials: systemd-creds "
                            "encrypt failed: %s", host, err.decode(errors="replace").strip()[:300])
            self._sealing[host] = False
            return False
        self._sealing[host] = True
        return True

    async def _unseal_on(self, host: str, credential: str, path: Path) -> str | None:
        """The text of an encrypted credential this daemon wrote (adoption after a restart)."""
        try:
            rc, out, _ = await self._hosts.run(host, ["systemd-creds", "decrypt", f"--name={credential}",
                                                      str(path), "-"])
        except (OSError, CapyError):
            return None
        return out.decode().strip() or None if rc == 0 else None

    async def _remove_files_on(self, host: str, paths: list[Path]) -> None:
        if host == LOCAL:
            for path in paths:
                path.unlink(missing_ok=True)
        elif self._hosts.entries.get(host) is not None:
            try:
                await self._hosts.run(host, ["rm", "-f", *map(str, paths)])
            except CapyError as exc:
                log.warning("could not remove %s on %s: %s", ", ".join(map(str, paths)), host, exc)


def _key_of_env_file(text: str | None) -> str | None:
    for line in (text or "").splitlines():
        key, _, value = line.partition("=")
        if key == "CAPYCTL_ENGINE_KEY":
            return value
    return None


def _write_private(path: Path, text: str) -> None:
    """A 0600 file written whole or not at all (a temporary file renamed in place): a reader
    such as systemd at exec time never sees half a key."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
