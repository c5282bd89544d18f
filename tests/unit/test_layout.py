"""The package's layout rules (docs/development.md): no import cycle among collabopt's modules, not even one broken
by a function-level import; the engine's layers import only the layers below them; the core never imports an
adapter or the frameworks they serve; modules stay under 400 lines (the few still over it may only shrink)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
# modules still over MAX_LINES (issue 32 splits them): each may only shrink; drop it from here once it fits
STILL_OVER: dict[str, int] = {}
# the engine's layers, lowest first: a module imports only modules of its own layer or below
ENGINE_LAYERS = [
    {"compat", "dialback", "relay_daemon", "streams", "protocol", "protocol_diloco", "protocol_download", "clipping",
     "part_reducer", "slices", "service_thread", "gather_protocol", "group_search", "record_signing"},
    {"p2p", "peer_addresses", "records", "replicas", "progress", "averaging", "robust_averaging", "state",
     "member_checks", "download_votes", "download_challenge", "progress_records", "allreduce", "averager",
     "round_schema", "state_service", "downloads", "gather_round", "gather_exchange",
     "model_records", "gradient_rounds", "powersgd_rounds", "parameter_rounds", "training_state",
     "training_components", "final_state"},
    {"loop"},
    {"lineage_check", "sync_download", "sync_round"},
    {"diloco_averaging", "diloco_round"},
    {"peer"},
]
# the two rounds are strategies over the same loop and services: neither imports the other
ROUNDS = (ENGINE_LAYERS[3], ENGINE_LAYERS[4])
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers", "collabopt.integrations")


def modules() -> dict[str, Path]:
    found = {}
    for base, package in ((ROOT / "collabopt", "collabopt"), (ROOT / "integrations", "collabopt.integrations")):
        for path in base.rglob("*.py"):
            parts = [part for part in path.relative_to(base).with_suffix("").parts if part != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports(path: Path) -> set[str]:
    """Every module name an import statement of ``path`` names, at any level (``from a import b``: a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    known = modules()
    # the package itself (collabopt/__init__.py) is the facade that imports its modules: not an edge
    return {name: {other for other in imports(path) if other in known and other not in (name, "collabopt")}
            for name, path in known.items()}


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    cycles = []

    def visit(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt == start:
                cycles.append(" -> ".join([*path, start]))
            elif nxt not in path and nxt > start:  # each cycle once, from its smallest module
                visit(start, nxt, [*path, nxt])

    for name in sorted(graph):
        visit(name, name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_engine_modules_import_only_their_layer_or_below():
    layer_of = {f"collabopt.engine.{name}": i for i, layer in enumerate(ENGINE_LAYERS) for name in layer}
    engine = {name for name in modules() if name.startswith("collabopt.engine.")}
    assert engine == set(layer_of), "every engine module belongs to one layer of ENGINE_LAYERS"
    graph = import_graph()
    upward = [f"{name} imports {other}" for name in sorted(engine) for other in sorted(graph[name])
              if other in layer_of and layer_of[other] > layer_of[name]]
    assert not upward, "\n".join(upward)
    sync, diloco = ({f"collabopt.engine.{name}" for name in layer} for layer in ROUNDS)
    across = [f"{name} imports {other}" for one, two in ((sync, diloco), (diloco, sync)) for name in sorted(one)
              for other in sorted(graph[name]) if other in two]
    assert not across, "\n".join(across)


def test_no_class_of_collabopt_subclasses_hivemind_optimizer():
    """collabopt's loop composes hivemind's parts (DHT, averagers, tracker); it does not patch hivemind's optimizer."""
    import importlib
    import inspect

    import hivemind

    found = [f"{name}.{cls.__name__}" for name in sorted(modules()) if name.startswith("collabopt.engine")
             or name in ("collabopt.optimizer", "collabopt.diloco")
             for cls in vars(importlib.import_module(name)).values()
             if inspect.isclass(cls) and issubclass(cls, hivemind.Optimizer)]
    assert not found, found


def test_the_core_imports_no_adapter_and_no_framework():
    found = [f"{name}: {other}" for name, path in sorted(modules().items()) if not name.startswith(
        "collabopt.integrations") for other in sorted(imports(path)) if other.startswith(FRAMEWORKS)]
    assert not found, "\n".join(found)


def test_the_installed_package_holds_no_test_tooling():
    """The launcher and the network namespaces are the tests' and benchmarks' (``harness/``, not installed): the
    package never imports them, nor the tests or the benchmarks, and installs only its own folders."""
    found = [f"{name}: {other}" for name, path in sorted(modules().items()) for other in sorted(imports(path))
             if other.split(".")[0] in ("harness", "benchmarks", "tests", "helpers")]
    assert not found, "\n".join(found)
    packages = re.search(r"^packages = (.*)$", (ROOT / "pyproject.toml").read_text(), re.MULTILINE)[1]
    assert packages == '["collabopt", "collabopt.engine", "collabopt.integrations"]'
    assert not any((ROOT / "collabopt" / "testing").rglob("*.py"))  # (a checkout may keep its ignored __pycache__)


def test_modules_stay_under_the_line_limit():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    over = {name: size for name, size in sizes.items() if size > MAX_LINES and name not in STILL_OVER}
    assert not over, f"modules over {MAX_LINES} lines: {over}: split them by concern"
    grown = {name: (sizes.get(name), limit) for name, limit in STILL_OVER.items() if sizes.get(name, 0) > limit}
    assert not grown, f"modules still over {MAX_LINES} lines grew (now, allowed): {grown}"
    fits = [name for name in STILL_OVER if sizes.get(name, 0) <= MAX_LINES]
    assert not fits, f"{fits} fit in {MAX_LINES} lines now: drop them from STILL_OVER"
