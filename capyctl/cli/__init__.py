"""The ``capyctl`` command: ``capyctl <action> <resource> [options]``.

Everything but ``validate``, ``start`` and ``daemon`` talks to the running daemon through
its management socket.
"""

# PYTHON_ARGCOMPLETE_OK
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import argcomplete

from .. import __version__
from ..errors import CapyError
from ..spec import DeploymentSpec, EngineSpec, ManifestError, load_manifest, problems_in_file
from ._client import ApiClient
from ._output import error, human_age, human_bytes, print_json, print_table

EXIT_ERROR = 1
EXIT_USAGE = 2

DESCRIPTION = """\
CapyCTL runs more LLMs than a GPU machine can hold. Each model server (vLLM, SGLang,
TensorFold, llama.cpp's llama-server or a custom engine) runs as a transient systemd unit
capyctl-<deployment>.service in capyctl.slice, behind one OpenAI-compatible endpoint with
an API key. A parked model releases its memory and wakes on the next request for it.
"""

EPILOG = """\
examples:
  capyctl validate --file smollm2.yaml
  capyctl deploy model --file smollm2.yaml --activate --wait
  capyctl list deployments
  capyctl key create --name laptop --models smollm2
  capyctl park deployment smollm2
  capyctl logs deployment smollm2 -f
  capyctl usage
  capyctl inspect deployment smollm2
  capyctl drain host gpu-2 && capyctl uncordon host gpu-2

environment:
  CAPYCTL_STATE_DIR    state directory (default /var/lib/capyctl)
  CAPYCTL_RUNTIME_DIR  runtime directory holding api.sock (default /run/capyctl)
  CAPYCTL_API_SOCKET   management socket to talk to (default $CAPYCTL_RUNTIME_DIR/api.sock)
  CAPYCTL_CONFIG       the daemon's configuration file (default /etc/capyctl/config.yaml)

files:
  /etc/capyctl/config.yaml    the daemon's settings (capyctl validate config; systemctl reload capyctl)
  /etc/systemd/system/capyctl.{service,socket}, capyctl-api.socket, capyctl.slice
  /var/lib/capyctl/state.db   engines, deployments and revisions, API keys, hosts

exit status: 0 success, 1 the operation failed, 2 bad usage or an invalid manifest.
see also: systemctl status 'capyctl-*', journalctl -u capyctl-<deployment>
"""


CONFIG_HELP = ("configuration file (default: $CAPYCTL_CONFIG, else /etc/capyctl/config.yaml if it exists); "
               "flags and CAPYCTL_* variables win over it")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=100)


def _deployment_names(prefix, parsed_args, **_):
    try:
        return [d["name"] for d in ApiClient(getattr(parsed_args, "api_socket", None), timeout=2)
                .request("GET", "/v1/deployments") if d["name"].startswith(prefix)]
    except Exception:
        return []


def _engine_names(prefix, parsed_args, **_):
    try:
        return [e["name"] for e in ApiClient(getattr(parsed_args, "api_socket", None), timeout=2)
                .request("GET", "/v1/engines") if e["name"].startswith(prefix)]
    except Exception:
        return []


# -- commands that need no daemon ------------------------------------------------------------

def cmd_validate_config(args) -> int:
    from ..config_file import ConfigError, config_path, load_config
    path, _ = config_path(args.path)
    try:
        config = load_config(path, required=True)
    except ConfigError as exc:
        if args.json:
            print_json(exc.to_dict() | {"file": str(path), "valid": False})
        else:
            print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print_json({"file": str(path), "valid": True, "config": config.model_dump(mode="json")})
    else:
        print(f"{path}: valid configuration")
    return 0


def cmd_validate(args) -> int:
    if args.what == "config":
        if args.file:
            error("give the configuration file as PATH, not --file")
            return EXIT_USAGE
        return cmd_validate_config(args)
    if args.path or not args.file:
        error("give manifests with --file FILE, or check the daemon's configuration with 'validate config [PATH]'")
        return EXIT_USAGE
    status = 0
    results = []
    for path in args.file:
        try:
            spec = load_manifest(path)
        except ManifestError as exc:
            status = EXIT_USAGE
            results.append(exc.to_dict() | {"file": path, "valid": False})
            if not args.json:
                print(str(exc), file=sys.stderr)
            continue
        kind = "deployment" if isinstance(spec, DeploymentSpec) else "engine"
        results.append({"file": path, "valid": True, "kind": kind, "name": spec.name})
        if not args.json:
            print(f"{path}: valid {kind} manifest {spec.name!r}")
    if args.json:
        print_json(results if len(results) > 1 else results[0])
    return status


def cmd_start(args) -> int:
    from ..daemon import run_standalone
    return run_standalone(listen=args.listen, no_auth=args.no_auth, bus_address=args.bus_address,
                          config=args.config)


def cmd_daemon(args) -> int:
    from ..daemon import run_service
    return run_service(bus_address=args.bus_address, config=args.config)


# -- deployments -----------------------------------------------------------------------------

def _ready(d: dict) -> str:
    """READY as ready/desired members: 1/1, 0/1 (parked), 0/2 (a multi-node group not serving)."""
    members = d.get("members") or {"ready": 1 if d["state"] == "ready" else 0, "desired": 1}
    return f"{members['ready']}/{members['desired']}"


def _row(d: dict) -> list:
    return [d["name"], d["state"], _ready(d), d["revision"],
            ",".join(d.get("hosts") or []) or "local", d.get("engine"),
            d.get("reason") or ""]


# States of a replica that serves or is about to: the replicas a deployment wants now.
_UP = ("ready", "starting", "waking")


def deployment_rows(rows: list[dict]) -> list[list]:
    """One row per deployment from the API's one per replica: READY is its ready replicas over
    those it wants now (replicas.min, or more while scaled up or starting), STATE ready while
    any replica serves, HOSTS every replica's."""
    groups: dict[str, list[dict]] = {}
    for d in rows:
        groups.setdefault((d.get("replica") or {}).get("deployment", d["name"]), []).append(d)
    out = []
    for name, members in groups.items():
        members.sort(key=lambda d: (d.get("replica") or {}).get("index", 1))
        if len(members) == 1 and (members[0].get("replica") or {}).get("max", 1) == 1:
            out.append(_row(members[0]))
            continue
        first, spec = members[0], members[0].get("replica") or {}
        ready = sum(d["state"] == "ready" for d in members)
        wanted = max(spec.get("min", 1), sum(d["state"] in _UP for d in members))
        hosts = sorted({h for d in members for h in (d.get("hosts") or [])})
        out.append([name, "ready" if ready else first["state"], f"{ready}/{wanted}", first["revision"],
                    ",".join(hosts) or "local", first.get("engine"),
                    "; ".join(f"{d['name']}: {d['reason']}" for d in members if d.get("reason"))])
    return out


def spec_body(spec: DeploymentSpec | EngineSpec) -> dict:
    """A manifest as the API receives it: what differs from the defaults, which the daemon fills
    in again. A daemon older than this CLI then accepts every manifest that uses none of the
    fields it does not know, rather than refusing a field sent only with its default."""
    return spec.model_dump(mode="json", exclude_defaults=True)


def cmd_deploy(args) -> int:
    try:
        spec = load_manifest(args.file)
    except ManifestError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    if not isinstance(spec, DeploymentSpec):
        error(f"{args.file} is an engine manifest; use 'capyctl engine add --file {args.file}'")
        return EXIT_USAGE
    body = {"spec": spec_body(spec), "activate": args.activate, "wait": args.wait}
    client = ApiClient(args.api_socket)
    final = None
    try:
        events = client.stream("POST", "/v1/deployments", body)
        first = next(events, None)
    except CapyError as exc:
        # What only the daemon can check (the cores its hosts have) comes back as manifest
        # problems: shown on their lines in the file, as a local validation error would be.
        problems = exc.detail.get("problems") if exc.code == "invalid_manifest" and isinstance(exc.detail, dict) \
            else None
        if problems:
            raise problems_in_file(args.file, problems) from None
        raise
    for event in itertools.chain([first] if first is not None else [], events):
        kind = event.get("event")
        if kind == "progress" and not args.json:
            print(f"{spec.name}: {event['message']}", file=sys.stderr, flush=True)
        elif kind == "error":
            err = event["error"]
            raise CapyError(err["message"], code=err["code"])
        elif kind == "done":
            final = event["deployment"]
    if final is None:
        raise CapyError("the daemon closed the connection before the deploy finished", code="deploy_interrupted")
    if args.json:
        print_json(final)
    else:
        print(f"deployment {final['name']} revision {final['revision']}: {final['state']}")
    return 0


def cmd_list(args) -> int:
    client = ApiClient(args.api_socket)
    what = args.resource
    if what == "deployments":
        rows = client.request("GET", "/v1/deployments")
        if args.json:
            print_json(rows)
        else:
            print_table(["NAME", "STATE", "READY", "REVISION", "HOSTS", "ENGINE", "REASON"], deployment_rows(rows))
    elif what == "engines":
        rows = client.request("GET", "/v1/engines")
        if args.json:
            print_json(rows)
        else:
            print_table(["NAME", "TYPE", "VERSION", "PATH"],
                        [[e["name"], e["type"], e.get("version"), e.get("path")] for e in rows])
    elif what == "keys":
        return cmd_key_list(args)
    elif what == "hosts":
        rows = client.request("GET", "/v1/hosts")
        if args.json:
            print_json(rows)
        else:
            print_table(["NAME", "STATE", "GPUS", "MEMORY (FREE / TOTAL)", "ENGINES"],
                        [[h["name"], h["state"], h.get("gpus", 0),
                          f"{human_bytes(h.get('memory_free'))} / {human_bytes(h.get('memory_total'))}",
                          ",".join(h.get("engines") or [])] for h in rows])
    return 0


# -- hosts -----------------------------------------------------------------------------------

def cmd_host_info(args) -> int:
    from ..hosts import host_inventory
    inv = host_inventory()
    if args.json:
        print(inv.to_json())
    else:
        print(f"{inv.hostname}: {inv.cpu_count} CPUs in {len(inv.cores)} cores, "
              f"RAM {human_bytes(inv.ram_available)} free of "
              f"{human_bytes(inv.ram_total)}, " + (f"{len(inv.gpus)} GPUs" if inv.gpus else
                                                   f"no GPUs ({inv.nvml_error})"))
        for g in inv.gpus:
            print(f"  GPU {g.index}: {g.name}, {human_bytes(g.memory_free)} free of {human_bytes(g.memory_total)}")
    return 0


def cmd_host_add(args) -> int:
    body = {"name": args.name, "ssh": args.ssh, "port": args.port,
            "identity": str(Path(args.identity).resolve()) if args.identity else None,
            "known_hosts": str(Path(args.known_hosts).resolve()) if args.known_hosts else None}
    if args.unified_memory is not None:
        body["unified_memory"] = args.unified_memory == "yes"
    h = ApiClient(args.api_socket, timeout=120).request("POST", "/v1/hosts", body)
    print_json(h) if args.json else print(f"host {h['name']}: {h['state']} ({h.get('hostname') or args.ssh})")
    return 0


def cmd_host_list(args) -> int:
    args.resource = "hosts"
    return cmd_list(args)


def cmd_host_remove(args) -> int:
    ApiClient(args.api_socket).request("DELETE", f"/v1/hosts/{args.name}")
    print(f"host {args.name} removed")
    return 0


def cmd_host_check(args) -> int:
    r = ApiClient(args.api_socket, timeout=180).request("POST", f"/v1/hosts/{args.name}/check")
    if args.json:
        print_json(r)
        return 0 if r.get("reachable") else EXIT_ERROR
    if not r.get("reachable"):
        error(f"host {args.name} is not reachable: {r.get('message') or r.get('error')}")
        return EXIT_ERROR
    info = r.get("host_info") or {}
    print(f"host {args.name}: reachable, latency {r.get('latency_ms')} ms, systemd {r.get('systemd_version')}")
    if info:
        print(f"  {info.get('hostname')}: {info.get('cpu_count')} CPUs, RAM {human_bytes(info.get('ram_available'))} "
              f"free of {human_bytes(info.get('ram_total'))}, {len(info.get('gpus') or [])} GPUs")
    return 0


def cmd_status(args) -> int:
    d = ApiClient(args.api_socket).request("GET", f"/v1/deployments/{args.name}")
    if args.json:
        print_json(d)
        return 0
    now = time.time()
    print(f"{d['name']} - revision {d['revision']}, engine {d['engine']}")
    print(f"   State: {d['state']}" + (f" ({d['reason']})" if d.get("reason") else ""))
    print(f"    Unit: {d['unit']}")
    print(f"   Model: {d.get('model')}")
    if d.get("socket"):
        print(f"Endpoint: {d['socket']} (unix socket only root can open, per-launch key)")
    elif d.get("port"):
        print(f"Endpoint: 127.0.0.1:{d['port']} (loopback, per-launch key)")
    print(f"  Memory: {human_bytes(d.get('memory_current'))}")
    print(f"Requests: {d.get('in_flight', 0)} in flight, {d.get('waiting', 0)} waiting")
    if d.get("replicas"):
        spec = d.get("replica") or {}
        print(f"Replicas: {sum(r['state'] == 'ready' for r in d['replicas'])} ready of {len(d['replicas'])} "
              f"(min {spec.get('min')}, max {spec.get('max')})")
        for r in d["replicas"]:
            note = " (held out: drained or stopped by name)" if r.get("held") else \
                "" if r.get("routable") or r["state"] != "ready" else " (out of routing)"
            print(f"  {r['unit']}: {r['state']} on {r['host']}, rev {r['revision']}, "
                  f"{r['in_flight']} in flight, {r['waiting']} waiting{note}"
                  + (f" ({r['reason']})" if r.get("reason") else ""))
    room = d.get("waiting_for_room")
    if room:
        print(f"    Turn: waiting {room['seconds']:.0f}s for room held by busy deployments"
              + (f", {room['ahead']} deployment(s) ahead" if room.get("ahead") else ""))
    elif d.get("door") == "closed":
        print("    Turn: yielding: it finishes the requests it admitted, then another deployment's turn comes")
    if d.get("last_used"):
        print(f"Last use: {human_age(now - d['last_used'])} ago")
    for line in park_lines(d):
        print(line)
    if d.get("journal"):
        print("\nLast journal lines:")
        for line in d["journal"]:
            print(f"  {line}")
    return 0


def park_lines(d: dict) -> list[str]:
    """The park tier, the latest park record and the parsers of ``capyctl status``."""
    lines = []
    record = d.get("park_record") or {}
    if d.get("park_tier"):
        lines.append(f"    Park: tier {d['park_tier']}" + (f"; in-place park off: {record['in_place_disabled']}"
                                                           if record.get("in_place_disabled") else ""))
    if record.get("parked_at"):
        retained = sum((record.get("retained") or {}).values())
        lines.append(f"          last park reached {record.get('tier')}" + (
            f", still holding {human_bytes(retained)} (kept charged)" if retained else ", memory released"))
    if d.get("armed"):
        lines.append("          armed: the next launch's unit is started and waits at its gate")
    proof = record.get("proof") or {}
    if record.get("wake_seconds") is not None:
        lines.append(f"          last wake {record['wake_seconds']:.2f}s, proof {proof.get('result', 'none')}"
                     + (f" ({proof['reason']})" if proof.get("reason") else ""))
    for what in ("wake", "park"):
        timeline = record.get(f"last_{what}")
        if timeline:
            lines.append(f"          last {what}'s phases: {timeline_line(timeline)}")
    cache_line = prompt_cache_line(record.get("prompt_cache") or {})
    if cache_line:
        lines.append(f"          prompt cache: {cache_line}")
    parsers = d.get("parsers")
    if parsers:
        for what, key in (("tool calls", "tool_call_parser"), ("reasoning", "reasoning_parser")):
            lines.append(f" Parsers: {what}: {parsers.get(key) or 'none'} ({parsers.get(key + '_source')}"
                         + (f", model_type {parsers['model_type']}" if parsers.get("model_type") else "") + ")")
    return lines


def timeline_line(timeline: dict) -> str:
    """A wake's or park's phases in order (capyctl/controller/_timeline.py), and a swap's length."""
    phases = ", ".join(f"{p['phase']} {p['seconds'] * 1000:.0f} ms" for p in timeline.get("phases") or [])
    evicted = [e.get("deployment") for e in timeline.get("evicted") or []]
    swap = timeline.get("swap_seconds")
    return (phases or "none") + (f"; evicted {', '.join(evicted)}" if evicted else "") + (
        f"; {swap:.2f}s from their last answer to its first" if swap is not None else "")


def prompt_cache_line(cache: dict) -> str | None:
    """What the latest park kept of the prompt cache, or its latest wake restored."""
    state = cache.get("state")
    if state == "saved":
        return f"{cache.get('tokens', 0)} tokens saved at the park ({human_bytes(cache.get('bytes') or 0)})"
    if state == "restored":
        saved = cache.get("seconds_saved")
        return (f"{cache.get('tokens', 0)} tokens restored in {cache.get('restore_seconds', 0):.3f}s"
                + (f", {saved:.2f}s of prefill saved" if saved is not None else ""))
    if state in ("refused", "dropped", "failed"):
        return f"{state}: {cache.get('why')}"
    return None


def _action(verb: str):
    def run(args) -> int:
        d = ApiClient(args.api_socket, timeout=None).request("POST", f"/v1/deployments/{args.name}/{verb}")
        if args.json:
            print_json(d)
        else:
            print(f"deployment {d['name']}: {d['state']}")
        return 0
    return run


def cmd_delete(args) -> int:
    d = ApiClient(args.api_socket, timeout=None).request("DELETE", f"/v1/deployments/{args.name}")
    print_json(d) if args.json else print(f"deployment {args.name} deleted")
    return 0


def cmd_logs(args) -> int:
    path = f"/v1/deployments/{args.name}/logs?lines={args.lines}" + ("&follow=1" if args.follow else "")
    client = ApiClient(args.api_socket, timeout=None)
    try:
        for event in client.stream("GET", path):
            print(event["line"], flush=True)
    except KeyboardInterrupt:
        pass
    return 0


# -- usage and the MCP server ----------------------------------------------------------------

def _figure(value, unknown: dict, field: str, amount=human_bytes) -> str:
    # A figure CapyCTL could not measure reads "unknown", never "0" or "-": the reason follows the table.
    if value is None:
        return "unknown" if field in unknown else "-"
    return amount(value)


def _cores(count: int) -> str:
    return f"{count} core" + ("" if count == 1 else "s")


def cmd_usage(args) -> int:
    view = ApiClient(args.api_socket, timeout=60).request("GET", "/v1/usage")
    if args.json:
        print_json(view)
        return 0
    reasons: list[str] = []

    def note(what: str, unknown: dict) -> None:
        reasons.extend(f"{what} {field}: {why}" for field, why in sorted(unknown.items()))

    rows = []
    for host in view["hosts"]:
        note(f"host {host['host']}", host.get("unknown") or {})
        for d in host["domains"]:
            unknown = d.get("unknown") or {}
            note(d["id"], unknown)
            amount = _cores if d.get("kind") == "cpu" else human_bytes
            rows.append([d["id"], host["state"], d.get("model") or "", amount(d["capacity"]),
                         _figure(d["available"], unknown, "available", amount), amount(d["reserved"]),
                         amount(d["unreserved"])])
    print_table(["DOMAIN", "HOST STATE", "MODEL", "CAPACITY", "AVAILABLE", "RESERVED", "UNRESERVED"], rows)
    print()
    rows = []
    for dep in view["deployments"]:
        unknown = dep.get("unknown") or {}
        note(f"deployment {dep['name']}", unknown)
        idle = human_age(dep["idle_seconds"]) if dep["idle_seconds"] is not None else "unknown"
        held = []
        for d in dep["domains"]:
            note(f"deployment {dep['name']} on {d['id']}", d.get("unknown") or {})
            amount = _cores if d["id"].startswith("cpu:") else human_bytes
            held.append(f"{d['id']}={_figure(d['held'], d.get('unknown') or {}, 'held', amount)}")
        # The cores it runs on: CPU ids (and how many cores) per host; "-": not pinned, or not running.
        cores = " ".join(f"{c['host']}:{c['cpus']} ({_cores(c['count'])})" for c in dep.get("cores") or []) or "-"
        rows.append([dep["name"], dep["state"], dep["host"], cores, dep["in_flight"], dep["waiting"], idle,
                     " ".join(held)])
    print_table(["DEPLOYMENT", "STATE", "HOST", "CORES", "IN FLIGHT", "WAITING", "IDLE", "HELD"], rows)
    if reasons:
        print("\nunknown figures:")
        for line in reasons:
            print(f"  {line}")
    return 0


def cmd_ui(args) -> int:
    from ._client import default_socket
    from ._ui import run
    return run(args.api_socket or default_socket(), args.port, args.open)


def cmd_mcp(args) -> int:
    from ..config import Paths
    if args.action == "rotate-key":
        r = ApiClient(args.api_socket).request("POST", "/v1/operator-key/rotate")
        print(f"operator key rotated; the new one is in {r['path']} (the old one is refused from now on); "
              "give it to your MCP clients")
        import os
        import shutil
        import subprocess
        # The unit received the old key as a credential at start: restart it if it runs.
        if os.geteuid() == 0 and shutil.which("systemctl"):
            subprocess.run(["systemctl", "try-restart", "capyctl-mcp.service"], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return 0
    import os
    from ..mcp import serve
    from ._client import default_socket
    key_path = args.operator_key_file or (
        Path(os.environ["CREDENTIALS_DIRECTORY"]) / "operator-key" if os.environ.get("CREDENTIALS_DIRECTORY")
        else Paths.from_env().credentials_dir / "operator.key")
    return serve(listen=args.listen or os.environ.get("CAPYCTL_MCP_LISTEN") or "127.0.0.1:7444",
                 api_socket=getattr(args, "api_socket", None) or default_socket(), key_path=Path(key_path),
                 allowed_origins=args.allow_origin or [], max_concurrent=args.max_concurrent)


# -- engines and keys ------------------------------------------------------------------------

def cmd_engine_add(args) -> int:
    body: dict = {"name": args.name}
    if args.file:
        body["spec"] = spec_body(load_manifest(args.file))
    else:
        body["path"] = str(Path(args.path).resolve())
    e = ApiClient(args.api_socket).request("POST", "/v1/engines", body)
    print_json(e) if args.json else print(f"engine {e['name']}: {e['type']} {e.get('version') or ''} at {e.get('path')}")
    return 0


def cmd_engine_list(args) -> int:
    args.resource = "engines"
    return cmd_list(args)


def cmd_engine_remove(args) -> int:
    ApiClient(args.api_socket).request("DELETE", f"/v1/engines/{args.name}")
    print(f"engine {args.name} removed")
    return 0


def cmd_key_create(args) -> int:
    models = [m for m in (args.models or "").split(",") if m] or None
    k = ApiClient(args.api_socket).request("POST", "/v1/keys", {"name": args.name, "models": models})
    if args.json:
        print_json(k)
    else:
        print(k["key"])
        print(f"(key {k['id']} {k['name']!r}; shown once, stored hashed"
              + (f"; models: {', '.join(models)}" if models else "; all models") + ")", file=sys.stderr)
    return 0


def cmd_key_list(args) -> int:
    rows = ApiClient(args.api_socket).request("GET", "/v1/keys")
    if args.json:
        print_json(rows)
    else:
        print_table(["ID", "NAME", "MODELS", "CREATED", "REVOKED"],
                    [[k["id"], k["name"], ",".join(k["models"]) if k["models"] else "all",
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(k["created_at"])),
                      "yes" if k["revoked_at"] else "no"] for k in rows])
    return 0


def cmd_key_revoke(args) -> int:
    k = ApiClient(args.api_socket).request("DELETE", f"/v1/keys/{args.id}")
    print(f"key {k['id']} ({k['name']}) revoked")
    return 0


# -- inspect, drain, uncordon, engine detect ------------------------------------------------------

def _print_fields(data: dict, indent: str = "") -> None:
    """Nested JSON as indented "key: value" lines, for people (--json gives the JSON itself)."""
    for key, value in data.items():
        if isinstance(value, dict) and value:
            print(f"{indent}{key}:")
            _print_fields(value, indent + "  ")
        elif isinstance(value, list) and value and any(isinstance(v, (dict, list)) for v in value):
            print(f"{indent}{key}:")
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    print(f"{indent}  - [{i}]")
                    _print_fields(item, indent + "      ")
                else:
                    print(f"{indent}  - {item}")
        elif isinstance(value, list):
            print(f"{indent}{key}: {', '.join(map(str, value)) if value else '-'}")
        else:
            print(f"{indent}{key}: {'-' if value is None or value == {} else value}")


def cmd_inspect(args) -> int:
    client = ApiClient(args.api_socket, timeout=60)
    path = {"deployment": f"/v1/deployments/{args.name}/inspect", "engine": f"/v1/engines/{args.name}",
            "host": f"/v1/hosts/{args.name}/inspect"}[args.resource]
    data = client.request("GET", path)
    if args.json:
        print_json(data)
    else:
        _print_fields(data)
    return 0


def cmd_drain(args) -> int:
    if args.resource == "deployment":
        d = ApiClient(args.api_socket, timeout=None).request("POST", f"/v1/deployments/{args.name}/drain")
        if args.json:
            print_json(d)
        else:
            print(f"{d['name']}: {d['state']}" + (f"; out of routing until 'capyctl wake deployment {d['name']}'"
                                                   if "@" in d["name"] else ""))
        return 0
    r = ApiClient(args.api_socket, timeout=None).request("POST", f"/v1/hosts/{args.name}/drain")
    if args.json:
        print_json(r)
        return 0 if r["drained"] else EXIT_ERROR
    print(f"host {args.name} cordoned: no new deployment is placed there ('capyctl uncordon host {args.name}' "
          "undoes it)")
    for d in r["deployments"]:
        if d["error"]:
            error(f"deployment {d['name']}: {d['error']['message']} ({d['error']['code']})")
        else:
            print(f"deployment {d['name']}: {d['action']}" + (f" to {d['host']}" if d["action"] == "moved" else ""))
    return 0 if r["drained"] else EXIT_ERROR


def cmd_uncordon(args) -> int:
    r = ApiClient(args.api_socket).request("POST", f"/v1/hosts/{args.name}/uncordon")
    if args.json:
        print_json(r)
    else:
        print(f"host {args.name} takes placements again" if r["was_cordoned"]
              else f"host {args.name} was not cordoned")
    return 0


def cmd_engine_detect(args) -> int:
    import asyncio
    from ..engines import find_engines
    from ..engines._detect import DETECT_ROOTS
    roots = [str(Path(p).resolve()) for p in args.path] if args.path else None
    found = asyncio.run(find_engines(roots, search_path=not args.path))
    if args.json:
        print_json([e.model_dump(mode="json") for e in found])
        return 0
    if not found:
        where = ", ".join(roots or ["$PATH", *DETECT_ROOTS])
        print(f"no engine install found under {where}", file=sys.stderr)
        return 0
    print_table(["TYPE", "VERSION", "PATH", "REGISTER WITH"],
                [[e.type, e.version, e.path, f"capyctl engine add {e.path}"] for e in found])
    return 0


# -- the parser ------------------------------------------------------------------------------

def _common(p: argparse.ArgumentParser, json_flag: bool = True) -> None:
    if json_flag:
        p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--api-socket", metavar="PATH", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="capyctl", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=_Formatter)
    parser.add_argument("--version", action="version", version=f"capyctl {__version__}")
    parser.add_argument("--api-socket", metavar="PATH",
                        help="management socket (default: $CAPYCTL_API_SOCKET or /run/capyctl/api.sock)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, help: str, description: str | None = None, **kw) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=description or help, formatter_class=_Formatter, **kw)

    p = add("validate", "check manifests, or the daemon's configuration file, without using them",
            "capyctl validate --file FILE...: validate deployment or engine manifests.\n"
            "capyctl validate config [PATH]: validate the daemon's configuration file (default:\n"
            "$CAPYCTL_CONFIG, else /etc/capyctl/config.yaml), as the daemon and 'systemctl reload\n"
            "capyctl' read it. Each problem is printed as FILE:LINE: FIELD: message; the exit status\n"
            "is 2 if anything is invalid.")
    p.add_argument("what", nargs="?", choices=["config"], help="config: the daemon's configuration file")
    p.add_argument("path", nargs="?", metavar="PATH", help="with config: the file to check").completer = \
        argcomplete.FilesCompleter(("yaml", "yml"))
    p.add_argument("--file", "-f", action="append", metavar="FILE",
                   help="manifest to check (repeatable)").completer = argcomplete.FilesCompleter(("yaml", "yml"))
    _common(p)
    p.set_defaults(func=cmd_validate)

    p = add("start", "run CapyCTL in the foreground",
            "Run the daemon in the foreground. Under systemd the service is socket-activated instead\n"
            "(systemctl start capyctl.socket); 'start standalone' binds the sockets itself.")
    p.add_argument("mode", choices=["standalone"], help="standalone: one host, sockets bound by CapyCTL")
    p.add_argument("--listen", default=None, metavar="HOST:PORT", help="OpenAI endpoint (default 127.0.0.1:8000)")
    p.add_argument("--no-auth", action="store_true", help="serve the OpenAI endpoint without API keys (development only)")
    p.add_argument("--bus-address", metavar="ADDRESS", help="D-Bus address of the systemd to drive (default: system bus)")
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    p.set_defaults(func=cmd_start)

    p = add("daemon", "the system service's entry point (socket-activated by capyctl.socket)",
            "The packaged service's entry point: listens on the sockets systemd passes (capyctl.socket,\n"
            "capyctl-api.socket) and reads its configuration file; SIGHUP (systemctl reload capyctl)\n"
            "reads the file again and applies what can change live.")
    p.add_argument("--bus-address", metavar="ADDRESS", help=argparse.SUPPRESS)
    p.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    p.set_defaults(func=cmd_daemon)

    p = add("deploy", "deploy a model from a manifest",
            "Record a deployment (a changed manifest becomes a new revision) and, with --activate,\n"
            "start it now; otherwise it starts on the first request for it.")
    p.add_argument("resource", choices=["model"])
    p.add_argument("--file", "-f", required=True, metavar="FILE", help="deployment manifest (YAML)").completer = \
        argcomplete.FilesCompleter(("yaml", "yml"))
    p.add_argument("--activate", action="store_true", help="start the deployment now")
    p.add_argument("--wait", action="store_true", help="with --activate: wait until it serves, printing progress")
    _common(p)
    p.set_defaults(func=cmd_deploy)

    p = add("list", "list deployments, engines, keys or hosts")
    p.add_argument("resource", choices=["deployments", "engines", "keys", "hosts"])
    _common(p)
    p.set_defaults(func=cmd_list)

    for verb, helptext, func in (
            ("status", "show one deployment: state, unit, memory, last journal lines", cmd_status),
            ("park", "park a deployment: release its memory; the next request wakes it", _action("park")),
            ("wake", "wake a parked or stopped deployment now", _action("wake")),
            ("stop", "stop a deployment's unit; it stays recorded and wakes on a request", _action("stop")),
            ("delete", "stop a deployment and forget it", cmd_delete)):
        p = add(verb, helptext, helptext if verb == "delete" else helptext + ".\n\nNAME is a deployment (every "
                "one of its replicas) or one replica of it, NAME@K (docs/replicas.md).")
        p.add_argument("resource", choices=["deployment"])
        p.add_argument("name", help="deployment name, or a replica's (chat@2)").completer = _deployment_names
        _common(p)
        p.set_defaults(func=func)

    p = add("inspect", "everything known about a deployment, an engine or a host",
            "inspect deployment NAME: state, manifest, revisions, the last launch record, the cards it\n"
            "  was planned on, its idle-park setting and its host's settings.\n"
            "inspect engine NAME: the registered engine (type, path, version) and the deployments using it.\n"
            "inspect host NAME: state, inventory (GPUs, RAM, CPUs), whether it is cordoned, whether it\n"
            "  allows engine development controls, and the deployments on it ('local' is this host).")
    p.add_argument("resource", choices=["deployment", "engine", "host"])
    p.add_argument("name", help="its name")
    _common(p)
    p.set_defaults(func=cmd_inspect)

    p = add("drain", "close a host to new deployments, or take one replica out of service",
            "drain host NAME: cordon the host (kept across daemon restarts): no deployment is placed or\n"
            "woken there. Then each deployment on it is parked out of place, releasing its memory there;\n"
            "one that was serving and may run on another host (its manifest's hosts) is woken there\n"
            "instead. A deployment that may only run on a drained host answers 503 host_cordoned until\n"
            "'capyctl uncordon host NAME'. Exit status 1 if a deployment could not be parked.\n\n"
            "drain deployment NAME@K: take replica K of a deployment out of routing, let its requests\n"
            "finish, then park it; its siblings serve meanwhile, and scaling leaves it alone until\n"
            "'capyctl wake deployment NAME@K'. drain deployment NAME parks every replica the same way.")
    p.add_argument("resource", choices=["host", "deployment"])
    p.add_argument("name", help="host name ('local' is this host), or deployment or replica name (chat@2)")
    _common(p)
    p.set_defaults(func=cmd_drain)

    p = add("uncordon", "open a drained host to deployments again",
            "Undo 'capyctl drain host NAME': deployments may be placed and woken there again. Parked\n"
            "deployments stay parked until a request wakes them.")
    p.add_argument("resource", choices=["host"])
    p.add_argument("name", help="host name")
    _common(p)
    p.set_defaults(func=cmd_uncordon)

    p = add("usage", "how full each GPU and the host RAM are, and what each deployment holds",
            "Per memory domain (each GPU, each host's RAM): its capacity, the available memory measured\n"
            "now (NVML, /proc/meminfo), what CapyCTL has reserved for deployments and what is left\n"
            "unreserved. Per deployment: its state, requests in flight and waiting, how long since its\n"
            "last request, and the bytes it holds in each domain (NVML per process, its unit's cgroup).\n"
            "A figure that could not be measured reads 'unknown', with the reason under the tables;\n"
            "--json gives the same view as GET /v1/usage and the MCP usage tool.")
    _common(p)
    p.set_defaults(func=cmd_usage)

    p = add("ui", "open the dashboard: a loopback port forwarded to the management socket",
            "Serve the dashboard (deployments, memory per GPU and host RAM, request rates, journals,\n"
            "park/wake/stop) on http://127.0.0.1:PORT/ui/, forwarded to the management socket, and print\n"
            "its URL. The URL carries a session secret in its fragment: anyone holding it is admin\n"
            "while this runs. Requests without it, from another Host or another Origin are refused.\n"
            "Runs until Ctrl-C. Over SSH: ssh -L PORT:127.0.0.1:PORT host capyctl ui --port PORT")
    p.add_argument("--port", type=int, default=0, metavar="PORT", help="loopback port (default: any free one)")
    p.add_argument("--open", action="store_true", help="open the URL in this machine's browser")
    p.set_defaults(func=cmd_ui)

    p = add("mcp", "serve the MCP server for AI agents, or rotate its operator key",
            "capyctl mcp [serve]: a Model Context Protocol server (streamable HTTP at /mcp) whose tools\n"
            "mirror the management API: list, usage, status, deploy, park, wake, stop, delete, drain, logs.\n"
            "It reaches CapyCTL through the management socket with the operator key, and every MCP\n"
            "request must carry that key: Authorization: Bearer <key>. The key is created by the daemon\n"
            "on its first start in /var/lib/capyctl/credentials/operator.key (0600); the admin token and\n"
            "API keys are refused. The endpoint is plain HTTP: beyond a trusted LAN put TLS in front.\n"
            "The packaged unit is capyctl-mcp.service (disabled until you enable it).\n\n"
            "capyctl mcp rotate-key: replace the operator key (admin only); the old one is refused at once.",
            epilog="environment:\n  CAPYCTL_MCP_LISTEN  address to listen on (default 127.0.0.1:7444)\n"
                   "  CREDENTIALS_DIRECTORY  set by systemd: the key is read from its operator-key")
    p.add_argument("action", nargs="?", choices=["serve", "rotate-key"], default="serve")
    p.add_argument("--listen", metavar="HOST:PORT", help="address to serve MCP on (default 127.0.0.1:7444)")
    p.add_argument("--operator-key-file", metavar="FILE",
                   help="the operator key (default /var/lib/capyctl/credentials/operator.key)")
    p.add_argument("--allow-origin", action="append", metavar="ORIGIN",
                   help="a browser Origin to accept besides this machine's loopback (repeatable)")
    p.add_argument("--max-concurrent", type=int, default=16, metavar="N",
                   help="requests served at once; more answer 429 (default 16)")
    _common(p, json_flag=False)
    p.set_defaults(func=cmd_mcp)

    p = add("logs", "show a deployment's journal (journalctl -u capyctl-NAME)")
    p.add_argument("resource", choices=["deployment"])
    p.add_argument("name").completer = _deployment_names
    p.add_argument("-n", "--lines", type=int, default=50, help="how many lines (default 50)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    _common(p, json_flag=False)
    p.set_defaults(func=cmd_logs)

    engine = add("engine", "register, list and remove engines")
    esub = engine.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = esub.add_parser("add", help="register an engine found at PATH, or described by a manifest",
                        description="Detect what PATH is (a llama-server binary, or a virtual environment with\n"
                                    "vllm, sglang or tensorfold), record its version, and register it.",
                        formatter_class=_Formatter)
    p.add_argument("path", nargs="?", help="binary or virtual environment")
    p.add_argument("--name", help="name deployments use (default: the engine type)")
    p.add_argument("--file", metavar="FILE", help="engine manifest (kind: engine) instead of PATH")
    _common(p)
    p.set_defaults(func=cmd_engine_add)
    p = esub.add_parser("detect", help="find engine installs on this host (needs no daemon)",
                        description="Look for llama-server binaries ($PATH, and DIR, DIR/*, DIR/*/* under each\n"
                                    "root, bin/ and build/bin/ included) and virtual environments with vllm,\n"
                                    "sglang or tensorfold installed, and print each with its version. Nothing is\n"
                                    "registered: 'capyctl engine add PATH' does that. Default roots: /opt,\n"
                                    "/usr/local, /srv, /var/lib/capyctl/engines, /var/cache/capyctl-build.",
                        formatter_class=_Formatter)
    p.add_argument("path", nargs="*", metavar="DIR", help="search these directories instead of the defaults")
    _common(p)
    p.set_defaults(func=cmd_engine_detect)
    p = esub.add_parser("list", help="list registered engines")
    _common(p)
    p.set_defaults(func=cmd_engine_list)
    p = esub.add_parser("remove", help="remove an engine no deployment uses")
    p.add_argument("name").completer = _engine_names
    _common(p)
    p.set_defaults(func=cmd_engine_remove)

    host = add("host", "add, list, check and remove hosts reached over SSH",
               "Remote hosts run deployments in their own systemd, driven over SSH (host keys are always\n"
               "verified: add the host's key to known_hosts first). Engines and models are expected at the\n"
               "same paths as on this host.")
    hsub = host.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = hsub.add_parser("add", help="connect to a host over SSH, check it and record it", formatter_class=_Formatter)
    p.add_argument("name", help="the name deployments use in their `hosts` list")
    p.add_argument("--ssh", required=True, metavar="[USER@]ADDRESS", help="SSH target (an ssh_config alias works)")
    p.add_argument("--port", type=int, help="SSH port (default: ssh's own)")
    p.add_argument("--identity", metavar="FILE", help="private key to log in with")
    p.add_argument("--known-hosts", metavar="FILE", help="known_hosts file holding the host's key")
    p.add_argument("--unified-memory", choices=["yes", "no"],
                   help="whether the host's GPU and host memory are one pool (a park keeping weights in host RAM "
                        "frees nothing there). Known GPUs decide it; asked when they do not (GH200, GB200)")
    _common(p)
    p.set_defaults(func=cmd_host_add)
    p = hsub.add_parser("list", help="list hosts: state, GPUs, memory, engines")
    _common(p)
    p.set_defaults(func=cmd_host_list)
    p = hsub.add_parser("remove", help="forget a host no deployment runs on")
    p.add_argument("name")
    _common(p)
    p.set_defaults(func=cmd_host_remove)
    p = hsub.add_parser("check", help="reachability, latency, systemd version and inventory of a host")
    p.add_argument("name")
    _common(p)
    p.set_defaults(func=cmd_host_check)

    p = add("host-info", "print this machine's inventory: GPUs, RAM, CPUs (needs no daemon)")
    _common(p)
    p.set_defaults(func=cmd_host_info)

    key = add("key", "create, list and revoke API keys for the OpenAI endpoint")
    ksub = key.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = ksub.add_parser("create", help="create a key; it is printed once and stored hashed")
    p.add_argument("--name", default="default", help="a label for the key")
    p.add_argument("--models", metavar="M1,M2", help="limit the key to these models (others answer 404)")
    _common(p)
    p.set_defaults(func=cmd_key_create)
    p = ksub.add_parser("list", help="list keys (never their secrets)")
    _common(p)
    p.set_defaults(func=cmd_key_list)
    p = ksub.add_parser("revoke", help="revoke a key by id or name")
    p.add_argument("id")
    _common(p)
    p.set_defaults(func=cmd_key_revoke)

    from ..bench._cli import add_bench_parser
    add_bench_parser(sub)
    from ..recipes._cli import add_recipe_parser
    add_recipe_parser(sub, _Formatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argcomplete.autocomplete(parser)
    args = parser.parse_args(argv)
    if args.command == "engine" and args.action == "add" and not (args.path or args.file):
        parser.error("engine add needs PATH or --file")
    try:
        return args.func(args) or 0
    except CapyError as exc:
        error(f"{exc.message} ({exc.code})")
        return EXIT_USAGE if exc.status in (400, 422) else EXIT_ERROR
    except ManifestError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
