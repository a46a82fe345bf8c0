"""The controller package imports in one direction, and its actor uses only the narrow
DeploymentServices interface of the controller (capyctl/controller/_services.py); the proxy's
modules import in one direction and leave each other's private fields alone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from capyctl.controller._services import DeploymentServices

PACKAGE = Path(__file__).resolve().parents[2] / "capyctl" / "controller"


def _imports(path: Path) -> set[str]:
    """Sibling modules a module imports, anywhere in it (TYPE_CHECKING blocks and functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def _assert_no_cycle(graph: dict[str, set[str]]) -> None:
    """Depth-first over the module graph; the first cycle found fails with its path."""
    visiting, done = set(), set()

    def visit(module: str, path: list[str]) -> None:
        if module in done:
            return
        assert module not in visiting, f"import cycle: {' -> '.join([*path, module])}"
        visiting.add(module)
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        visiting.discard(module)
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_the_controller_package_has_no_import_cycle():
    graph = {p.stem: _imports(p) & {q.stem for q in PACKAGE.glob("*.py")} for p in PACKAGE.glob("*.py")}
    _assert_no_cycle(graph)
    assert "_controller" not in graph["_actor"] and "_actor" not in graph["_members"]
    # The controller's services (secrets, ports, cordons, metrics) sit below it and beside the
    # actor: neither is reached from them, even through another module.
    for service in ("_secrets", "_ports", "_cordons", "_metrics"):
        reached, todo = set(), [service]
        while todo:
            for target in graph[todo.pop()] - reached:
                reached.add(target)
                todo.append(target)
        above = reached & {"_controller", "_actor"}
        assert not above, f"{service} reaches {sorted(above)}"


def _package_graph(root: Path) -> dict[str, set[str]]:
    """Every module of ``root``'s package (a package is its __init__) -> the package's modules it
    imports, absolute or relative, anywhere in it (function-level imports too)."""
    modules: dict[str, tuple[Path, bool]] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)

    def module_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, is_package) in modules.items():
        here = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here.split(".")[:len(here.split(".")) - node.level + 1] if node.level else []
                source = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names if source.startswith(root.name) else ():
                    sub = module_of(f"{source}.{alias.name}")
                    targets.add(sub if sub and sub.startswith(source + ".") else module_of(source))
            elif isinstance(node, ast.Import):
                targets.update(module_of(a.name) for a in node.names if a.name.startswith(root.name + "."))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def test_capyctl_has_no_import_cycle_anywhere():
    graph = _package_graph(PACKAGE.parent)
    assert graph["capyctl.controller._actor"] >= {"capyctl.controller._lifecycle", "capyctl.config"}
    _assert_no_cycle(graph)


def test_the_engines_package_has_no_import_cycle():
    """Counting imports made under TYPE_CHECKING and inside functions, which only hide a cycle; and
    no adapter module imports the package's own __init__ (it imports them all)."""
    engines = PACKAGE.parent / "engines"
    modules = {q.stem for q in engines.glob("*.py")} - {"__init__"}
    _assert_no_cycle({p.stem: _imports(p) & modules for p in engines.glob("*.py") if p.stem != "__init__"})
    for path in engines.glob("*.py"):
        if path.stem == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module is None:
                names = {alias.name for alias in node.names}
                assert names <= modules, f"{path.name} imports {sorted(names - modules)} from capyctl.engines itself"


def test_the_actor_uses_only_what_deployment_services_declares():
    declared = {name for name in dir(DeploymentServices) if not name.startswith("__")}
    declared |= set(DeploymentServices.__annotations__)
    for module in ("_actor.py", "_members.py", "_liveness.py"):
        text = (PACKAGE / module).read_text()
        used = set(re.findall(r"\b(?:self\.controller|controller|self\.ctl|ctl)\.([A-Za-z_]+)", text))
        assert used <= declared, f"{module} reaches into the controller beyond its interface: {used - declared}"


def test_the_mcp_server_reaches_capyctl_only_over_the_management_api():
    """capyctl mcp is a client: it may not import the daemon's parts, only talk HTTP to the API."""
    daemon_parts = {"controller", "api", "proxy", "systemd", "scheduler", "store", "engines", "daemon", "hosts"}
    for path in (PACKAGE.parent / "mcp").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
                assert node.module.split(".")[0] not in daemon_parts, f"{path.name} imports capyctl.{node.module}"
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert not any(node.module.startswith(f"capyctl.{p}") for p in daemon_parts), path.name


def test_the_recipe_runner_reaches_capyctl_only_as_a_user_does():
    """capyctl recipe drives the capyctl command and the OpenAI endpoint: it reads manifests
    (spec) and measures with capyctl bench, and imports none of the daemon's parts."""
    daemon_parts = {"controller", "api", "proxy", "systemd", "scheduler", "store", "engines", "daemon", "hosts",
                    "sources", "mcp", "cli"}
    imported = set()
    for path in (PACKAGE.parent / "recipes").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
                imported.add(node.module.split(".")[0])
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert not node.module.startswith("capyctl."), f"{path.name} imports {node.module}"
    assert imported and not imported & daemon_parts, f"capyctl/recipes imports {sorted(imported & daemon_parts)}"
    assert imported <= {"spec", "bench"}, imported


PROXY = PACKAGE.parent / "proxy"


def _private_reaches(path: Path) -> list[str]:
    """``thing._field`` in a module where ``thing`` is not the object itself (self, cls, super())."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
            continue
        found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_of_the_proxy_reaches_into_another_objects_private_fields():
    # The door clients and engines pass: each object's state is changed through its own methods
    # (issue 32: the old front reached 19 private fields of other objects).
    assert [reach for path in sorted(PROXY.glob("*.py")) for reach in _private_reaches(path)] == []


def test_the_proxy_package_has_no_import_cycle():
    modules = {p.stem for p in PROXY.glob("*.py")}
    graph = {p.stem: _imports(p) & modules for p in PROXY.glob("*.py")}

    def reach(module: str, seen: set[str]) -> set[str]:
        for target in graph[module] - seen:
            seen.add(target)
            reach(target, seen)
        return seen
    assert [module for module in sorted(graph) if module in reach(module, set())] == []
    # Layers point down: the aiohttp wiring (_app) on intake, the relay and /v1/systemone; those on
    # the engine exchange (_upstream) and the request's state (_exchange); the engine client under all.
    assert reach("_engine_side", set()) == set() and reach("_engine_pool", set()) <= {"_engine_side", "connector"}
    for below in ("_exchange", "_intake", "_relay", "_upstream", "_systemone", "_sockets"):
        assert "_app" not in reach(below, set()), below
    assert "_intake" not in reach("_relay", set()) and "_relay" not in reach("_intake", set())


def test_no_module_of_the_proxy_imports_another_ones_private_names():
    imported = []
    for path in sorted(PROXY.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported += [f"{path.name}: {alias.name} from {node.module}" for alias in node.names
                             if node.module and alias.name.startswith("_")]
    assert imported == []


PROXY_FILE_LINES_MAX = 500


def test_no_file_of_the_proxy_is_over_500_lines():
    long = {path.name: n for path in PROXY.glob("*.py")
            if (n := len(path.read_text().splitlines())) > PROXY_FILE_LINES_MAX}
    assert long == {}
