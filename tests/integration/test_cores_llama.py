"""Cores on a CPU host, against the real llama-server in the sandboxed systemd: two CPU
deployments that fit beside each other run on disjoint cores, every thread of each engine bound
to its own, with -t/-tb to match; and a manifest asking for more cores than the host has is a
manifest error naming the field, on its line in the file."""

from __future__ import annotations

import os

import pytest

from capyctl.hosts import parse_cpu_list

from .capyhost import CapyHost

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]


def _engine(host: CapyHost, deployment: str) -> tuple[int, list[str], dict[int, list[int]]]:
    """The unit's main process: its pid, its argv and each of its threads' allowed CPUs, read
    from /proc inside the sandbox."""
    unit = f"capyctl-{deployment}.service"
    pid = int(host.unit_property(unit, "MainPID"))
    assert pid > 0, host.daemon_journal()
    argv = host.sh("cat", f"/proc/{pid}/cmdline").stdout.split("\0")
    script = 'for s in /proc/$1/task/*/status; do echo "$s $(grep Cpus_allowed_list "$s" | cut -f2)"; done'
    threads = {}
    for line in host.sh("sh", "-c", script, "threads", str(pid)).stdout.splitlines():
        path, allowed = line.split(" ", 1)
        threads[int(path.split("/")[4])] = parse_cpu_list(allowed)
    return pid, argv, threads


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_two_cpu_deployments_run_on_disjoint_cores_with_thread_flags_to_match(capyhost, smollm2):
    cores = len(os.sched_getaffinity(0))
    assert cores >= 2, "two deployments of one core each need a host of two cores"
    for name in ("left", "right"):
        manifest = capyhost.write_manifest(
            name, f"name: {name}\nengine: llama\nmodel: {{path: {smollm2}}}\nresources: {{cpus: 1}}\n")
        capyhost.cli("deploy", "model", "--file", str(manifest), "--activate", "--wait")
    assert {d["name"]: d["state"] for d in capyhost.cli_json("list", "deployments")} == \
        {"left": "ready", "right": "ready"}  # beside each other: neither evicted the other

    seen = {}
    for name in ("left", "right"):
        pid, argv, threads = _engine(capyhost, name)
        assert argv[0].endswith("llama-server"), argv
        assert _flag(argv, "-t") == _flag(argv, "-tb") == "1"  # one thread per core it was given
        allowed = threads[pid]
        assert len(allowed) == 1, threads
        assert all(cpus == allowed for cpus in threads.values()), threads  # every thread, not just main
        assert capyhost.unit_property(f"capyctl-{name}.service", "CPUWeight") == "50"
        seen[name] = allowed
    assert not set(seen["left"]) & set(seen["right"]), seen

    # Both answer, each on its own core.
    for name in ("left", "right"):
        assert capyhost.cli("status", "deployment", name).returncode == 0

    # capyctl usage shows each deployment's cores.
    rows = {row["name"]: row for row in capyhost.cli_json("usage")["deployments"]}
    for name in ("left", "right"):
        assert rows[name]["cores"] == [{"host": "local", "count": 1, "cpus": str(seen[name][0])}]
    table = capyhost.cli("usage").stdout
    assert f"local:{seen['left'][0]} (1 core)" in table and f"local:{seen['right'][0]} (1 core)" in table


def test_more_cores_than_the_host_has_is_a_manifest_error_naming_the_field(capyhost, smollm2):
    cores = len(os.sched_getaffinity(0))
    manifest = capyhost.write_manifest(
        "greedy", f"name: greedy\nengine: llama\nmodel:\n  path: {smollm2}\nresources:\n  cpus: {cores + 1}\n")
    out = capyhost.cli("deploy", "model", "--file", str(manifest), check=False)
    assert out.returncode == 2, out
    assert f"{manifest}:6: resources.cpus: asks for {cores + 1} cores" in out.stderr, out.stderr
    assert capyhost.cli_json("list", "deployments") == []  # nothing recorded
