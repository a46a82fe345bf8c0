"""Engine keys as systemd credentials: encrypted with systemd-creds where the host has it
(LoadCredentialEncrypted=), 0600 files where it has not (LoadCredential=); never both."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from capyctl.config import Paths
from capyctl.controller._secrets import EngineSecrets
from capyctl.errors import SystemdError
from capyctl.systemd._units import TransientUnit
from tests.components import missing, require_root


def unit(**fields) -> TransientUnit:
    return TransientUnit(name="capyctl-x.service", description="x", argv=["/bin/true"], **fields)


def test_encrypted_credentials_are_loaded_encrypted_and_the_rest_in_the_clear() -> None:
    props = dict(unit(credentials={"engine-key": "/s/x.cred", "sglang.yaml": "/s/sglang.yaml"},
                      encrypted_credentials=frozenset({"engine-key"})).properties())
    assert props["LoadCredentialEncrypted"].value == [["engine-key", "/s/x.cred"]]
    assert props["LoadCredential"].value == [["sglang.yaml", "/s/sglang.yaml"]]
    only_sealed = dict(unit(credentials={"engine-key": "/s/x.cred"},
                            encrypted_credentials=frozenset({"engine-key"})).properties())
    assert "LoadCredential" not in only_sealed


def test_an_encrypted_name_must_be_a_credential() -> None:
    with pytest.raises(SystemdError):
        unit(credentials={}, encrypted_credentials=frozenset({"engine-key"})).properties()


class FakeHosts:
    """hosts.run on "local" as a machine with or without a working systemd-creds."""

    def __init__(self, creds_work: bool) -> None:
        self.creds_work = creds_work
        self.calls: list[list[str]] = []
        self.entries: dict = {}

    async def run(self, host, argv, *, input=None, timeout=60.0):
        self.calls.append(argv)
        if argv[0] == "systemd-creds":
            if not self.creds_work:
                raise FileNotFoundError(2, "No such file or directory", "systemd-creds")
            Path(argv[-1]).write_bytes(b"sealed:" + bytes(reversed(input)))  # stands for the encrypted blob
            return 0, b"", b""
        if argv[0] == "chmod":
            Path(argv[2]).chmod(int(argv[1], 8))
            return 0, b"", b""
        raise AssertionError(argv)


def engine_secrets(tmp_path: Path, hosts) -> tuple[EngineSecrets, Path]:
    """The engine secrets of a daemon whose host registry is ``hosts``, and its secrets directory."""
    paths = Paths(tmp_path / "state", tmp_path / "run")
    paths.secrets_dir.mkdir(parents=True, mode=0o700)
    return EngineSecrets(paths, hosts), paths.secrets_dir


async def test_keys_are_encrypted_where_systemd_creds_works(tmp_path: Path) -> None:
    hosts = FakeHosts(creds_work=True)
    engine, secrets = engine_secrets(tmp_path, hosts)
    stale = secrets / "smol.key"
    stale.write_text("old clear key\n")  # from a launch before encryption
    credentials, sealed = await engine.launch_credentials_on("local", "smol", "k3y",
                                                             {"sglang-smol.yaml": "api_key: k3y"})
    assert credentials == {"engine-key": str(secrets / "smol.cred"), "sglang-smol.yaml": str(secrets / "sglang-smol.yaml.cred")}
    assert sealed == {"engine-key", "sglang-smol.yaml"}
    assert not stale.exists()  # no clear copy outlives the encrypted one
    assert all(b"k3y" not in Path(p).read_bytes() and Path(p).stat().st_mode & 0o777 == 0o600
               for p in credentials.values())
    assert ["systemd-creds", "encrypt", "--name=engine-key", "-", str(secrets / "smol.cred")] in hosts.calls


async def test_keys_are_0600_files_where_it_does_not_and_that_is_tried_once(tmp_path: Path, caplog) -> None:
    hosts = FakeHosts(creds_work=False)
    engine, secrets = engine_secrets(tmp_path, hosts)
    for name in ("a", "b"):
        credentials, sealed = await engine.launch_credentials_on("local", name, f"key-{name}", {})
        path = Path(credentials["engine-key"])
        assert sealed == frozenset() and path == secrets / f"{name}.key"
        assert path.read_text() == f"key-{name}\n" and path.stat().st_mode & 0o777 == 0o600
    assert sum(call[0] == "systemd-creds" for call in hosts.calls) == 1
    assert sum("not encrypted credentials" in r.message for r in caplog.records) == 1


async def test_a_key_sealed_by_the_real_systemd_creds_is_read_back_for_adoption(tmp_path: Path) -> None:
    if shutil.which("systemd-creds") is None:
        missing("needs systemd-creds (systemd 250 or newer; scripts/setup installs Debian's systemd)")
    require_root("(systemd-creds encrypts with the host key in /var/lib/systemd)")

    async def run(host, argv, *, input=None, timeout=60.0):
        import asyncio
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate(input)
        return proc.returncode, out, err
    engine, _ = engine_secrets(tmp_path, SimpleNamespace(run=run, entries={}))
    credentials, sealed = await engine.launch_credentials_on("local", "smol", "the-key", {})
    assert sealed == {"engine-key"}
    assert b"the-key" not in Path(credentials["engine-key"]).read_bytes()
    assert await engine.read_secret_key_on("local", "smol") == "the-key"


async def test_the_keys_of_a_host_s_adoptions_are_unsealed_in_one_command(tmp_path: Path) -> None:
    """A restart adopting many deployments on a host unseals their keys in one command there
    (Controller.reconcile), not one SSH session each; a key it could not unseal is read as before."""
    if shutil.which("systemd-creds") is None:
        missing("needs systemd-creds (systemd 250 or newer; scripts/setup installs Debian's systemd)")
    require_root("(systemd-creds encrypts with the host key in /var/lib/systemd)")
    calls: list[list[str]] = []

    async def run(host, argv, *, input=None, timeout=60.0):
        import asyncio
        calls.append(argv)
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate(input)
        return proc.returncode, out, err
    engine, secrets = engine_secrets(tmp_path, SimpleNamespace(run=run, entries={}))
    for name in ("a", "b", "c"):
        await engine.launch_credentials_on("local", name, f"key-of-{name}", {})
    (secrets / "c.cred").write_bytes(b"not a credential")  # c's does not unseal
    calls.clear()
    await engine.unseal_keys_on("local", ["a", "b", "c"])
    assert len(calls) == 1
    assert await engine.read_secret_key_on("local", "a") == "key-of-a"
    assert await engine.read_secret_key_on("local", "b") == "key-of-b"
    assert len(calls) == 1  # taken from the one command
    assert await engine.read_secret_key_on("local", "c") is None and len(calls) == 2  # read the usual way
    await engine.unseal_keys_on("local", ["a"])
    engine.forget_unsealed("local")
    calls.clear()
    assert await engine.read_secret_key_on("local", "a") == "key-of-a" and len(calls) == 1  # none left over
