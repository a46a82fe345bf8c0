"""One daemon driving many hosts over SSH: its own cost per host, and what an operator waits for.

A rig of sandboxed hosts (tests/netns/many.py: each host its own systemd and a real sshd, in a
network namespace of its own, on one bridge with the server) and the CapyCTL daemon as a service
of the server's systemd. One rig of the largest size; each size (--hosts 1,8,32) uses its first N
hosts with a fresh daemon and state. For each size:

- the daemon's RSS and CPU (from /proc of its PID: VmRSS, and its threads' run time in
  schedstat; CPU as % of one core over --idle seconds) with every host added and nothing
  deployed, and again with the deployments up; the CPU of its whole unit besides (its ssh
  masters and the ssh commands it runs: the unit's cgroup); the increment per host against the
  1-host figure of the same run;
- the processes in the daemon's unit and the file descriptors it holds, per host; the SSH
  connections per host (established TCP connections to port 22 in the server's namespace, ss -tn);
- `capyctl list hosts --json` and `capyctl list deployments --json` wall time, median of 5
  (after the deploy, so the list has every deployment in it), and the API's own answer time;
- deploying --deployments deployments, round-robin over the hosts, --parallel at once through the
  management API (what `capyctl deploy model --activate --wait` sends), wall time to all ready:
  an instant engine (benchmarks/daemon_scale.py's nginx, answering at once) and --llama of them
  the real llama-server with SmolLM2;
- `systemctl restart` of the daemon's unit until `list deployments` shows every deployment
  ready again, and how many engines were launched anew (each unit's InvocationID, before and
  after); when each host's sshd accepted the new daemon, and the new daemon's journal, tell
  where the time went;
- requests/s through the proxy to the instant deployments on the hosts: --clients concurrent
  clients for --seconds (1-token chat completions, aiohttp), p50 and p99, against 1 host.

Goals (issue 36, in benchmarks/bench_goals.py), PASS/MISS beside the figures: per idle host the
daemon's RSS and its unit's CPU (the increment over 1 host), SSH connections per host, each list
and the restart to all adopted at the largest size. A py-spy profile (--gil) of the daemon idle
with the deployments up at the largest size (when .venv has py-spy) shows where its CPU goes, and
the launches' phases from its journal where a deploy's time goes.

Needs root, iproute2, OpenSSH (scripts/setup), nginx (scripts/bench unpacks Debian's package),
llama-server and the SmolLM2 package (scripts/setup). The rig's own memory per host is printed.
Run: .venv/bin/python benchmarks/hosts_scale.py [--hosts 1,8,32] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_goals as G  # noqa: E402
from bench_summary import Row, p99, render_table  # noqa: E402
from daemon_scale import ANSWER, ENGINE_CONF  # noqa: E402
from proxy_vs_nginx import find_nginx  # noqa: E402

from capyctl.cli._client import ApiClient  # noqa: E402
from capyctl.errors import CapyError  # noqa: E402
from capyctl.spec.loader import parse_manifest  # noqa: E402
from tests.integration.capyhost import llama_server_path, smollm2_path  # noqa: E402
from tests.netns.many import (ManyHostRig, RigDaemon, cgroup_pids, missing_requirements, proc_comm,  # noqa: E402
                              proc_memory, write_instant_engine)

MiB = 1 << 20
TICK = os.sysconf("SC_CLK_TCK")
INSTANT = "name: {name}\nengine: instant\nmodel: {{path: {model}}}\nresources: {{ram: 64MiB}}\nhosts: [{host}]\n"
LLAMA = "name: {name}\nengine: llama\nmodel:\n  path: {model}\nhosts: [{host}]\n"


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


# -- the daemon's own figures ------------------------------------------------------------------------

def _stat(pid: int) -> tuple[int, int]:
    """(own utime+stime, waited-for children's cutime+cstime) in clock ticks (proc(5) /proc/pid/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14])


def _cgroup_usage_ns(daemon: RigDaemon, cgroup: str) -> int | None:
    """CPU time of every process that ran in the unit's cgroup: usage_usec of its cpu.stat in the
    unified hierarchy, present in every cgroup v2 whatever its controllers (the kernel's
    Documentation/admin-guide/cgroup-v2.rst, "cpu.stat"); systemd tracks units there in the
    hybrid layout the sandboxes use."""
    path = Path("/sys/fs/cgroup/unified") / f"capysb-{daemon.rig.server.sandbox}" / cgroup.lstrip("/") / "cpu.stat"
    try:
        for line in path.read_text().splitlines():
            if line.startswith("usage_usec "):
                return int(line.split()[1]) * 1000
    except (OSError, ValueError):
        pass
    return None


def _run_ns(pid: int) -> int:
    """Time the process's threads have run, in ns (the first field of each thread's schedstat):
    exact, where utime and stime are counted in clock ticks."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            pass  # a thread that ended meanwhile
    return total


def sample(daemon: RigDaemon, pid: int, cgroup: str) -> dict:
    own, children = _stat(pid)
    own_ns = _run_ns(pid)
    others = 0
    for other in cgroup_pids(daemon.rig.server.sandbox, cgroup):
        if other != pid:
            try:
                others += _stat(other)[0]
            except OSError:
                pass  # gone between the listing and the read
    return {"t": time.monotonic(), "own": own, "own_ns": own_ns, "children": children, "others": others,
            "cgroup_ns": _cgroup_usage_ns(daemon, cgroup)}


def idle_window(daemon: RigDaemon, seconds: float) -> dict:
    """The daemon's CPU (% of one core) over ``seconds`` of idleness, its RSS at the end."""
    pid, cgroup = daemon.main_pid(), daemon.cgroup()
    a = sample(daemon, pid, cgroup)
    time.sleep(seconds)
    b = sample(daemon, pid, cgroup)
    span = b["t"] - a["t"]
    pct = lambda ticks: 100.0 * ticks / TICK / span  # noqa: E731
    out = {"seconds": span, "cpu_daemon_pct": 100.0 * (b["own_ns"] - a["own_ns"]) / 1e9 / span,
           "cpu_daemon_ticks_pct": pct(b["own"] - a["own"]),
           "cpu_daemon_children_pct": pct(b["children"] - a["children"]),
           "cpu_unit_others_pct": pct(b["others"] - a["others"])}
    # The cgroup counts every process that ran in the unit, also the short ssh commands; without
    # it, the sum from /proc counts the same processes (the commands through the daemon's cutime).
    if a["cgroup_ns"] is not None and b["cgroup_ns"] is not None:
        out["cpu_unit_pct"] = 100.0 * (b["cgroup_ns"] - a["cgroup_ns"]) / 1e9 / span
        out["cpu_unit_source"] = "cgroup cpu.stat"
    else:
        out["cpu_unit_pct"] = out["cpu_daemon_pct"] + out["cpu_daemon_children_pct"] + out["cpu_unit_others_pct"]
        out["cpu_unit_source"] = "/proc"
    out["rss"], _ = _rss_hwm(pid)
    return out


def _rss_hwm(pid: int) -> tuple[int, int]:
    fields = {ln.split(":")[0]: ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
              if ln.startswith("Vm")}
    return int(fields["VmRSS"]) * 1024, int(fields["VmHWM"]) * 1024


def holdings(daemon: RigDaemon) -> dict:
    """The processes in the daemon's unit besides it (by name, with their memory), its children,
    and its open file descriptors."""
    pid = daemon.main_pid()
    others = [p for p in daemon.pids() if p != pid]
    by_comm: dict[str, int] = {}
    rss = pss = 0
    for p in others:
        by_comm[proc_comm(p)] = by_comm.get(proc_comm(p), 0) + 1
        r, s = proc_memory(p)
        rss, pss = rss + r, pss + s
    children = 0
    for p in others:
        try:
            if int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children += 1
        except OSError:
            pass
    return {"unit_processes": len(others), "unit_processes_by_name": by_comm, "children": children,
            "others_rss": rss, "others_pss": pss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def profile(daemon: RigDaemon, seconds: float) -> list[str]:
    """Where the daemon's Python runs, from ``seconds`` of py-spy samples taken only while it holds
    the GIL (--gil: an idle event loop waiting in epoll is not sampled), grouped by the innermost
    CapyCTL frame of each stack."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.access(spy, os.X_OK):
        return ["py-spy is not installed (pip install -e '.[bench]')"]
    target = Path(f"/var/tmp/hosts_scale-{os.getpid()}.spy")
    try:
        proc = subprocess.run([spy, "record", "--pid", str(daemon.main_pid()), "--duration", str(int(seconds)),
                               "--rate", "100", "--gil", "--nonblocking", "--format", "raw", "--output", str(target)],
                              capture_output=True, text=True, timeout=seconds + 60)
        if proc.returncode != 0 or not target.exists():
            return [f"py-spy failed: {proc.stderr.strip()[-300:]}"]
        lines = target.read_text().splitlines()
    finally:
        target.unlink(missing_ok=True)
    by_frame: dict[str, int] = {}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        ours = [f for f in frames if "capyctl/" in f and "capyctl/eventloop.py" not in f
                and "capyctl/daemon.py" not in f and "capyctl/cli/" not in f]
        key = (ours[-1] if ours else "(event loop)") + (f" -> {frames[-1]}" if ours and frames[-1] != ours[-1] else "")
        by_frame[key] = by_frame.get(key, 0) + int(count)
    total = sum(by_frame.values())
    head = [f"{total} samples holding the GIL in {seconds:g} s at 100/s ({total / seconds:.1f}% of a core)"]
    return head + [f"{100 * c / max(total, 1):5.1f}%  {k}" for k, c in sorted(by_frame.items(), key=lambda kv: -kv[1])[:8]]


def journal_since(daemon: RigDaemon, since: float) -> list[tuple[float, str, str]]:
    """The daemon unit's journal since ``since`` (epoch seconds): (time, level, message); the level
    is empty on a traceback's lines and systemd's own."""
    out = daemon.exec("journalctl", "-u", "capytest-daemon.service", "-o", "short-unix", "--no-pager",
                      f"--since=@{since:.6f}", check=False, timeout=120).stdout
    rows = []
    for line in out.splitlines():
        stamp, _, rest = line.partition(" ")
        message = rest.split(": ", 1)[-1]  # after "HOST capyctl[PID]: "
        level, _, text = message.partition(" ")
        if level in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            message = text.split(": ", 1)[-1]  # after the logger's name
        else:
            level = ""
        try:
            rows.append((float(stamp), level, message))
        except ValueError:
            continue
    return rows


PHASES = re.compile(r"ready in ([\d.]+)s, started \((.*)\)")


def deploy_phases(rows: list[tuple[float, str, str]]) -> dict[str, float]:
    """Median of each phase of the launches ("ready in 2.0s, started (make room 4 ms, ...)")."""
    phases: dict[str, list[float]] = {}
    for _, _, message in rows:
        m = PHASES.search(message)
        if not m:
            continue
        phases.setdefault("total", []).append(float(m.group(1)) * 1000)
        for part in m.group(2).split(", "):
            name, _, value = part.rpartition(" ")
            name, _, number = name.rpartition(" ")
            if value == "ms":
                with contextlib.suppress(ValueError):
                    phases.setdefault(name, []).append(float(number))
    return {name: statistics.median(v) for name, v in phases.items()}


# -- operations --------------------------------------------------------------------------------------

def timed_median(fn, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def deploy_all(daemon: RigDaemon, manifests: dict[str, str], parallel: int) -> float:
    """Every manifest deployed, activated and waited for, ``parallel`` at once; the wall time."""
    def deploy(text: str) -> None:
        spec = parse_manifest(text)
        body = {"spec": spec.model_dump(mode="json"), "activate": True, "wait": True}
        for event in ApiClient(str(daemon.api_socket), timeout=None).stream("POST", "/v1/deployments", body):
            if event.get("event") == "error":
                raise CapyError(event["error"]["message"], code=event["error"]["code"])

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        list(pool.map(deploy, manifests.values()))
    return time.perf_counter() - started


def deployments(daemon: RigDaemon) -> list[dict]:
    return ApiClient(str(daemon.api_socket), timeout=30).request("GET", "/v1/deployments")


def invocations(rig: ManyHostRig, hosts: list, workers: int = 8) -> dict[str, str]:
    """Each capyctl-* unit's InvocationID on the hosts, by host and unit."""
    script = ("for u in $(systemctl list-units --plain --no-legend --all 'capyctl-*.service' | awk '{print $1}'); "
              "do echo \"$u $(systemctl show -P InvocationID \"$u\")\"; done")

    def one(host) -> dict[str, str]:
        out = host.exec("sh", "-c", script, check=False).stdout
        return {f"{host.label}/{ln.split()[0]}": ln.split()[1] for ln in out.splitlines() if len(ln.split()) == 2}

    found: dict[str, str] = {}
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for part in pool.map(one, hosts):
            found.update(part)
    return found


def sshd_accepts(hosts: list, since: float, workers: int = 8) -> list[float]:
    """When each host's sshd accepted a login after ``since`` (epoch seconds), in seconds after it."""
    def one(host) -> float | None:
        out = host.exec("journalctl", "-u", "capymany-sshd", "-o", "short-unix", "--no-pager",
                        f"--since=@{int(since)}", check=False).stdout
        times = [float(ln.split()[0]) for ln in out.splitlines() if "Accepted publickey" in ln]
        times = [t for t in times if t >= since]
        return min(times) - since if times else None

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return sorted(t for t in pool.map(one, hosts) if t is not None)


def restart(daemon: RigDaemon, rig: ManyHostRig, hosts: list, names: list[str]) -> dict:
    before = invocations(rig, hosts)
    since = time.time()
    started = time.perf_counter()
    daemon.restart()
    ready_notified = time.perf_counter() - started
    deadline = time.perf_counter() + 600
    while True:
        try:
            states = {d["name"]: d["state"] for d in deployments(daemon)}
        except (CapyError, OSError):
            states = {}
        if all(states.get(n) == "ready" for n in names):
            break
        if time.perf_counter() > deadline:
            raise RuntimeError(f"not all adopted 600 s after the restart: {states}")
        time.sleep(0.1)
    wall = time.perf_counter() - started
    after = invocations(rig, hosts)
    relaunched = sorted(u for u in before if after.get(u) != before[u])
    accepts = sshd_accepts(hosts, since)
    rows = journal_since(daemon, since)
    serving = [t for t, _, m in rows if m.startswith("serving OpenAI endpoint")]
    adopted = [t for t, _, m in rows if m.startswith("deployment ") and m.endswith("-> ready")]
    # What the daemons did, for a miss's explanation: host lines, warnings and errors, not the
    # deployments' own transitions nor tracebacks' lines.
    notes = [f"{t - since:7.2f} s  {level} {m[:200]}" for t, level, m in rows
             if level and not m.startswith("deployment ")]
    return {"wall_s": wall, "ready_notified_s": ready_notified, "relaunched": len(relaunched),
            "serving_s": serving[-1] - since if serving else None,
            "first_adopted_s": adopted[0] - since if adopted else None,
            "last_adopted_s": adopted[-1] - since if adopted else None,
            "hosts_reconnected_by_poller": sum(1 for _, _, m in rows if "is reachable again" in m),
            "errors_logged": sum(1 for _, level, _ in rows if level == "ERROR"),
            "journal": notes[:60],
            "relaunched_units": relaunched[:10], "units": len(before),
            "sshd_accepted_first_s": accepts[0] if accepts else None,
            "sshd_accepted_last_s": accepts[-1] if accepts else None,
            "sshd_accepted_at_s": [round(t, 2) for t in accepts]}


async def _load(url: str, key: str, models: list[str], clients: int, seconds: float) -> dict:
    latencies: list[float] = []
    failures: dict[str, int] = {}

    async def client(http: aiohttp.ClientSession, first: int) -> None:
        i = first
        while time.perf_counter() < stop:
            body = {"model": models[i % len(models)], "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 1}
            i += clients
            t = time.perf_counter()
            try:
                async with http.post(url + "/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {key}"}) as r:
                    await r.read()
                    if r.status != 200:
                        failures[str(r.status)] = failures.get(str(r.status), 0) + 1
                        continue
            except aiohttp.ClientError as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                continue
            latencies.append(time.perf_counter() - t)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        started = time.perf_counter()
        stop = started + seconds
        await asyncio.gather(*(client(http, c) for c in range(clients)))
        wall = time.perf_counter() - started
    return {"requests": len(latencies), "rps": len(latencies) / wall, "median_s": statistics.median(latencies),
            "p99_s": p99(latencies), "failures": failures}


def requests_per_second(daemon: RigDaemon, key: str, models: list[str], clients: int, seconds: float) -> dict:
    # The proxy listens in the server's namespace: the client's sockets are made there.
    with daemon.entered():
        return asyncio.run(_load(daemon.base_url, key, models, clients, seconds))


def clean(daemon: RigDaemon, hosts: list, names: list[str]) -> None:
    """Delete every deployment, stop the daemon, stop whatever unit of it a host still has."""
    def delete(name: str) -> None:
        try:
            ApiClient(str(daemon.api_socket), timeout=None).request("DELETE", f"/v1/deployments/{name}")
        except (CapyError, OSError) as exc:
            log(f"delete {name}: {exc}")

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(delete, names))
        daemon.stop()
        list(pool.map(lambda h: h.exec("sh", "-c", "systemctl stop 'capyctl-*.service'; systemctl reset-failed",
                                       check=False), hosts))


# -- one size ----------------------------------------------------------------------------------------

def measure(rig: ManyHostRig, n: int, args: argparse.Namespace, nginx: str, llama: str | None,
            model: str) -> dict:
    hosts = rig.hosts[:n]
    daemon = RigDaemon(rig, suffix=f"n{n}")
    r: dict = {"hosts": n}
    names: list[str] = []
    try:
        daemon.start()
        started = time.perf_counter()
        daemon.add_hosts(hosts, workers=args.parallel)
        r["add_hosts_s"] = time.perf_counter() - started
        log(f"{n} hosts: added in {r['add_hosts_s']:.1f} s; idle {args.idle:g} s")
        time.sleep(args.settle)
        r["idle"] = idle_window(daemon, args.idle)
        r.update(holdings(daemon))
        r["ssh_connections"] = rig.ssh_connections()
        if n == len(rig.hosts):
            r["rig_memory_connected"] = rig.memory_per_host()

        write_instant_engine(daemon, nginx=nginx, nginx_conf=ENGINE_CONF.replace("@ANSWER@", ANSWER))
        if llama and args.llama:
            daemon.cli("engine", "add", llama, "--name", "llama")
        manifests = {}
        for i in range(args.deployments):
            host = hosts[i % n].label
            if i < args.llama and llama:
                manifests[f"llama-{i}"] = LLAMA.format(name=f"llama-{i}", model=model, host=host)
            else:
                manifests[f"instant-{i}"] = INSTANT.format(name=f"instant-{i}", model=model, host=host)
        names = list(manifests)
        log(f"{n} hosts: deploying {len(names)}")
        since = time.time()
        r["deploy_s"] = deploy_all(daemon, manifests, args.parallel)
        r["deploy_phases_ms"] = deploy_phases(journal_since(daemon, since))
        listed = deployments(daemon)
        r["deploy_ready"] = sum(1 for d in listed if d["state"] == "ready")
        r["deploy_placed_on"] = len({h for d in listed for h in d["hosts"]})
        log(f"{n} hosts: {r['deploy_ready']} ready in {r['deploy_s']:.1f} s")

        for what in ("hosts", "deployments"):
            r[f"list_{what}_s"] = timed_median(lambda: daemon.cli("list", what, "--json"))
            r[f"api_{what}_s"] = timed_median(
                lambda: ApiClient(str(daemon.api_socket)).request("GET", f"/v1/{what}"))
        r["cli_startup_s"] = timed_median(lambda: daemon.cli("--version"))

        time.sleep(args.settle)
        r["idle_deployed"] = idle_window(daemon, args.idle)
        r["fds_deployed"] = len(os.listdir(f"/proc/{daemon.main_pid()}/fd"))
        r["ssh_connections_deployed"] = rig.ssh_connections()
        if n == len(rig.hosts) and args.profile:
            log(f"{n} hosts: py-spy, {args.profile:g} s")
            r["profile_deployed"] = profile(daemon, args.profile)

        key = daemon.cli("key", "create", "--name", "bench").stdout.strip()
        instant = [name for name in names if name.startswith("instant-")]
        log(f"{n} hosts: {args.clients} clients for {args.seconds:g} s")
        r["load"] = requests_per_second(daemon, key, instant, args.clients, args.seconds)

        log(f"{n} hosts: restart")
        r["restart"] = restart(daemon, rig, hosts, names)
        log(f"{n} hosts: all adopted {r['restart']['wall_s']:.1f} s after the restart")
    except Exception as exc:  # noqa: BLE001 - the size is reported with why, the others go on
        r["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        r["journal"] = daemon.daemon_journal(40)[-3000:]
        log(f"{n} hosts: {r['error']}")
    finally:
        clean(daemon, hosts, names)
    return r


# -- the report --------------------------------------------------------------------------------------

def _per_host(results: dict, key) -> float | None:
    """The increment per host of ``key(size)`` from 1 host to the largest size."""
    sizes = sorted(int(s) for s in results if "error" not in results[s])
    if len(sizes) < 2 or sizes[0] != 1:
        return None
    lo, hi = results[str(sizes[0])], results[str(sizes[-1])]
    return (key(hi) - key(lo)) / (sizes[-1] - sizes[0])


def figures(results: dict) -> str:
    sizes = sorted(results, key=int)
    rows: list[tuple[str, callable]] = [
        ("add the hosts (s)", lambda r: f"{r['add_hosts_s']:.1f}"),
        ("daemon RSS idle (MiB)", lambda r: f"{r['idle']['rss'] / MiB:.1f}"),
        ("daemon CPU idle (% core)", lambda r: f"{r['idle']['cpu_daemon_pct']:.2f}"),
        ("  + reaped ssh commands", lambda r: f"{r['idle']['cpu_daemon_children_pct']:.2f}"),
        ("unit CPU idle (% core)", lambda r: f"{r['idle']['cpu_unit_pct']:.2f}"),
        ("processes in its unit", lambda r: f"{r['unit_processes']} ({r['children']} children)"),
        ("  their RSS / PSS (MiB)", lambda r: f"{r['others_rss'] / MiB:.0f} / {r['others_pss'] / MiB:.0f}"),
        ("open fds (idle / deployed)", lambda r: f"{r['fds']} / {r.get('fds_deployed', '-')}"),
        ("SSH connections", lambda r: f"{sum(r['ssh_connections'].values())} "
                                      f"(max {max(r['ssh_connections'].values(), default=0)}/host)"),
        ("deploy all to ready (s)", lambda r: f"{r['deploy_s']:.1f} ({r['deploy_ready']} ready)"),
        ("list hosts --json (s)", lambda r: f"{r['list_hosts_s']:.2f} (API {r['api_hosts_s'] * 1e3:.0f} ms)"),
        ("list deployments --json (s)", lambda r: f"{r['list_deployments_s']:.2f} "
                                                  f"(API {r['api_deployments_s'] * 1e3:.0f} ms)"),
        ("capyctl --version (s)", lambda r: f"{r['cli_startup_s']:.2f}"),
        ("daemon RSS deployed (MiB)", lambda r: f"{r['idle_deployed']['rss'] / MiB:.1f}"),
        ("daemon CPU deployed (%)", lambda r: f"{r['idle_deployed']['cpu_daemon_pct']:.2f}"),
        ("unit CPU deployed (%)", lambda r: f"{r['idle_deployed']['cpu_unit_pct']:.2f}"),
        ("requests/s through proxy", lambda r: f"{r['load']['rps']:.0f}"),
        ("  against 1 host", lambda r: f"{r['load']['rps'] / results['1']['load']['rps']:.2f}x"),
        ("  p50 / p99 (ms)", lambda r: f"{r['load']['median_s'] * 1e3:.1f} / {r['load']['p99_s'] * 1e3:.1f}"),
        ("restart to all adopted (s)", lambda r: f"{r['restart']['wall_s']:.1f} (READY {r['restart']['ready_notified_s']:.1f})"),
        ("  engines relaunched", lambda r: f"{r['restart']['relaunched']} of {r['restart']['units']}"),
        ("  sshd accepted first/last (s)", lambda r: f"{r['restart']['sshd_accepted_first_s'] or 0:.1f} / "
                                                     f"{r['restart']['sshd_accepted_last_s'] or 0:.1f}"),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{'hosts':{width}}  " + "  ".join(f"{s:>22}" for s in sizes)]
    for label, fmt in rows:
        cells = []
        for s in sizes:
            try:
                cells.append(fmt(results[s]))
            except (KeyError, TypeError, ValueError):
                cells.append("-")
        lines.append(f"{label:{width}}  " + "  ".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def ssh_per_host(size: dict) -> list[int]:
    """The SSH connections to each host of one size: those the rig saw by address, and 0 for each
    host it saw none to."""
    seen = list(size["ssh_connections"].values())
    return seen + [0] * max(0, size["hosts"] - len(seen))


def goals(results: dict) -> list[Row]:
    ok = {s: r for s, r in results.items() if "error" not in r}
    top = str(max((int(s) for s in ok), default=0))
    big = ok.get(top)
    rss = _per_host(ok, lambda r: r["idle"]["rss"])
    cpu_unit = _per_host(ok, lambda r: r["idle"]["cpu_unit_pct"])
    cpu_own = _per_host(ok, lambda r: r["idle"]["cpu_daemon_pct"])
    rows = [
        Row("daemon RSS per idle host", "n/a" if rss is None else
            f"{rss / MiB:+.2f} MiB/host (1 -> {top} hosts, same run)", G.RSS_PER_HOST.shown,
            G.RSS_PER_HOST.judge(rss), rss),
        Row("daemon CPU per idle host", "n/a" if cpu_unit is None else
            f"{cpu_unit:+.3f}% core/host with its ssh processes ({cpu_own:+.3f}% the daemon's own)",
            G.CPU_PER_HOST.shown, G.CPU_PER_HOST.judge(cpu_unit), cpu_unit),
    ]
    # Each host's connections, a host the rig saw none to counting 0: every one judged by the goal.
    per_host = [n for r in ok.values() for n in ssh_per_host(r)]
    worst = G.SSH_PER_HOST.worst(per_host)
    rows.append(Row("SSH connections per host", "n/a" if worst is None else
                    f"{min(per_host)}-{max(per_host)} per host over {len(per_host)} hosts; "
                    f"{sum(1 for n in per_host if G.SSH_PER_HOST.judge(n) != 'PASS')} off the goal",
                    G.SSH_PER_HOST.shown, G.SSH_PER_HOST.judge(worst), worst))
    for what in ("hosts", "deployments"):
        figure = big.get(f"list_{what}_s") if big else None
        rows.append(Row(f"list {what} at {top} hosts", "n/a" if figure is None else
                        f"{figure:.2f} s (median of 5, capyctl --json)", G.LIST_S.shown,
                        G.LIST_S.judge(figure), figure))
    rs = big.get("restart") if big else None
    status = "n/a" if rs is None else "MISS" if rs["relaunched"] else G.RESTART_S.judge(rs["wall_s"])
    rows.append(Row(f"restart to all adopted at {top} hosts", "n/a" if rs is None else
                    f"{rs['wall_s']:.1f} s, {rs['relaunched']} of {rs['units']} engines relaunched",
                    G.RESTART_S.shown, status, rs and rs["wall_s"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="1,8,32", help="sizes to measure, comma-separated (default 1,8,32)")
    parser.add_argument("--deployments", type=int, default=64)
    parser.add_argument("--llama", type=int, default=2, help="how many of them run llama-server (default 2)")
    parser.add_argument("--parallel", type=int, default=8, help="host adds and deploys at once (default 8)")
    parser.add_argument("--idle", type=float, default=30.0, help="idle window for CPU, seconds (default 30)")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds before an idle window")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0, help="load duration (default 10)")
    parser.add_argument("--profile", type=float, default=10.0, help="py-spy seconds at the largest size; 0: none")
    parser.add_argument("--nginx")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = sorted({int(s) for s in args.hosts.split(",") if s.strip()})
    result: dict = {"sizes": sizes, "deployments": args.deployments, "llama": args.llama, "clients": args.clients,
                    "idle_s": args.idle, "machine": {"cpus": os.cpu_count(),
                                                      "ram": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
                    "results": {}}

    def finish(error: str | None = None) -> None:
        if error:
            result["error"] = error
            print(f"hosts_scale: {error}", file=sys.stderr)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        if error:
            sys.exit(1)

    reason = missing_requirements()
    if reason:
        finish(reason)
    model = smollm2_path()
    if model is None:
        finish("needs the SmolLM2 package (scripts/setup): the llama model, and a file for the instant engine")
    llama = llama_server_path()
    if llama is None and args.llama:
        finish("needs llama-server (scripts/setup llama.cpp), or --llama 0")
    nginx = find_nginx(args.nginx)

    rig = ManyHostRig(max(sizes), workers=args.parallel)
    log(f"rig {rig.run_id}: {max(sizes)} hosts")
    try:
        rig.up()
        result["rig"] = {"run_id": rig.run_id, "up_s": rig.up_seconds, "memory_per_host": rig.memory_per_host(),
                         "inotify_instances_raised": rig.inotify_raised}
        mem = result["rig"]["memory_per_host"]
        log(f"rig up in {rig.up_seconds:.1f} s; {mem['rss'] / MiB:.1f} MiB RSS, {mem['pss'] / MiB:.1f} MiB PSS a host")
        for n in sizes:
            result["results"][str(n)] = measure(rig, n, args, nginx, llama, model)
            finish()  # what is measured so far stays, should a later size fail
    except Exception as exc:  # noqa: BLE001
        finish(f"{type(exc).__name__}: {str(exc)[:800]}")
    finally:
        rig.down()

    results = result["results"]
    mem = result["rig"]["memory_per_host"]
    print(f"rig: {max(sizes)} hosts up in {result['rig']['up_s']:.0f} s; each host's sandbox "
          f"(systemd, journald, dbus, sshd) {mem['rss'] / MiB:.1f} MiB RSS, {mem['pss'] / MiB:.1f} MiB PSS")
    connected = results.get(str(max(sizes)), {}).get("rig_memory_connected")
    if connected:
        print(f"     with the daemon connected (its sshd session added): {connected['rss'] / MiB:.1f} MiB RSS, "
              f"{connected['pss'] / MiB:.1f} MiB PSS a host")
    print(f"{args.deployments} deployments ({args.llama} llama-server, the rest nginx answering at once), "
          f"{args.clients} clients for {args.seconds:g} s, idle windows of {args.idle:g} s\n")
    print(figures(results))
    for s, r in results.items():
        if "error" in r:
            print(f"\n{s} hosts failed: {r['error']}")
    big = results.get(str(max(sizes)), {})
    if big.get("deploy_phases_ms"):
        print(f"\na launch at {max(sizes)} hosts, median ms of each phase (the daemon's journal): " +
              ", ".join(f"{k} {v:.0f}" for k, v in big["deploy_phases_ms"].items()))
    rs = big.get("restart")
    if rs:
        at = lambda key: "?" if rs.get(key) is None else f"{rs[key]:.1f}"  # noqa: E731
        print(f"\nrestart at {max(sizes)} hosts, seconds after `systemctl restart`: the hosts' sshd accepted the new "
              f"daemon at {at('sshd_accepted_first_s')} .. {at('sshd_accepted_last_s')} (one host after another), "
              f"it served from {at('serving_s')}, its host poller reconnected {rs['hosts_reconnected_by_poller']} "
              f"hosts ('is reachable again'), deployments turned ready {at('first_adopted_s')} .. "
              f"{at('last_adopted_s')}; {rs['errors_logged']} ERROR lines in the journal meanwhile")
    if big.get("profile_deployed"):
        print(f"\nthe idle daemon at {max(sizes)} hosts with the deployments up, py-spy --gil "
              "(innermost CapyCTL frame -> innermost frame):")
        print("\n".join("  " + line for line in big["profile_deployed"]))
    rows = goals(results)
    result["goals"] = [r.__dict__ for r in rows]
    print()
    print(render_table(rows))
    finish()


if __name__ == "__main__":
    main()
