"""Code health as part of the suite: the linter (ruff) and the type checker (mypy) find nothing,
with the rules and settings of pyproject.toml; the import graph of ``elastic_llm`` has no cycle
and no upward edge (every import, lazy ones in functions included, goes down :data:`LAYERS`).

So `python3 -m pytest -q`, the README's test command that CI runs, fails on a lint finding as
on a failing test, and nobody needs a second command to keep the code clean.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)  # mypy from a cold cache: about 30 s here


def test_ruff_finds_nothing():
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode != 0:
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "."], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_mypy_finds_nothing(tmp_path):
    if subprocess.run([sys.executable, "-m", "mypy", "--version"], capture_output=True).returncode != 0:
        pytest.fail("mypy is not installed: pip install -e '.[test]'")
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


# Lowest first: a unit may import only units before it (and its own package's modules).
LAYERS = (
    "sources", "shape", "clock", "remote", "priority", "logs", "events", "files", "hosts", "lease", "spans", "telemetry", "cadence", "tensors", "model", "policies", "config",
    "stream", "data", "checkpoint", "export",
    "snapshot", "durable", "recovery", "monitor", "pipeline", "chaos", "controller", "runtime",
    "ops", "experiment", "replay", "sim", "soak", "fleet_cli", "cli",
)


def _module_imports() -> dict[str, set[str]]:
    """Every module of elastic_llm -> the modules of elastic_llm it imports (anywhere in it)."""
    root = REPO / "elastic_llm"
    mods = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join([*base, node.module] if node.module else base)
                named = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in mods]
                out.update(named or ([target] if target in mods else []))
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in mods)
        graph[name] = out - {name}
    return graph


def _unit(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_no_import_goes_up_a_layer():
    graph = _module_imports()
    units = {_unit(m) for m in graph if m != "elastic_llm"}
    assert units <= set(LAYERS), f"add {sorted(units - set(LAYERS))} to LAYERS"
    rank = {u: i for i, u in enumerate(LAYERS)}
    up = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs
                if a != "elastic_llm" and b != "elastic_llm" and _unit(a) != _unit(b) and rank[_unit(b)] > rank[_unit(a)])
    assert up == [], "imports that go up a layer:\n" + "\n".join(up)


def test_no_import_cycle():
    graph = _module_imports()
    cycles, seen = [], set()
    for start in sorted(graph):  # a cycle through `start`: a path back to it
        stack, visited = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start and frozenset(path) not in seen:
                    seen.add(frozenset(path))
                    cycles.append(" -> ".join((*path, start)))
                elif nxt not in visited and nxt != "elastic_llm":
                    visited.add(nxt)
                    stack.append((nxt, (*path, nxt)))
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def _imports_of(path: Path) -> set[str]:
    """Every module name ``path`` imports, lazy imports in functions included."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_the_controller_imports_neither_ray_nor_a_runtime():
    """The state machine and the orchestration above the ports (elastic_llm/controller) run on
    any runtime: none of their modules imports Ray or one of the runtimes."""
    bad = sorted(
        f"{path.relative_to(REPO)}: {mod}"
        for path in (REPO / "elastic_llm" / "controller").glob("*.py")
        for mod in _imports_of(path)
        if mod == "ray" or mod.startswith(("ray.", "elastic_llm.runtime", "elastic_llm.sim"))
    )
    assert bad == [], "the controller must reach Ray only through its ports:\n" + "\n".join(bad)


ORCHESTRATION = {"evacuate", "grow", "look", "execute", "decide", "drain_moves", "fewest_drops", "reattach", "resume_durable", "open_parts", "start_from", "build_observation"}


def test_the_simulation_implements_primitives_and_no_orchestration():
    """elastic_llm/sim holds no second copy of the controller's orchestration (no evacuate, grow,
    look or execute of its own) and never imports the Ray runtime."""
    found = []
    for path in (REPO / "elastic_llm" / "sim").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ORCHESTRATION:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} def {node.name}")
        found += [f"{path.relative_to(REPO)}: imports {m}" for m in _imports_of(path) if m.startswith("elastic_llm.runtime") or m == "ray" or m.startswith("ray.")]
    assert found == [], "the simulation must run the controller's orchestration, not its own:\n" + "\n".join(found)


def test_modules_stay_within_their_size():
    """Every module at most 600 lines, the Trainer (the state machine and its handlers) at most 400."""
    sizes = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines()) for path in (REPO / "elastic_llm").rglob("*.py")}
    big = sorted(f"{p} ({n} lines)" for p, n in sizes.items() if n > 600)
    assert big == [], "split these by job:\n" + "\n".join(big)
    assert sizes["elastic_llm/controller/trainer.py"] <= 400, sizes["elastic_llm/controller/trainer.py"]


def test_every_tensor_reaches_numpy_through_the_device_safe_helper():
    """``tensor.numpy()`` fails on a CUDA tensor: the stage, its copies, transport, snapshots and
    restores convert through elastic_llm.tensors (its ``host`` moves a tensor to host memory first)."""
    calls = []
    for path in sorted((REPO / "elastic_llm").rglob("*.py")):
        if path.name == "tensors.py" and path.parent.name == "elastic_llm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "numpy" and not node.args:
                calls.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert calls == [], "convert with elastic_llm.tensors.host / host_bytes instead of .numpy():\n" + "\n".join(calls)


def test_the_stage_actors_front_has_the_workers_methods_and_imports_no_torch():
    """A process given a stage actor's handle loads the actor's class (Ray learns its methods so):
    the front (elastic_llm.pipeline.stage_actor) has every public method of the worker, each
    handing the call on, and importing it loads neither torch nor the worker."""
    import inspect

    from elastic_llm.pipeline.stage import StageWorker as Worker
    from elastic_llm.pipeline.stage_actor import STAGE_METHODS, StageWorker

    public = {n for n, v in inspect.getmembers(Worker) if callable(v) and not n.startswith("_")}
    assert set(STAGE_METHODS) == public, f"missing: {sorted(public - set(STAGE_METHODS))}, not the worker's: {sorted(set(STAGE_METHODS) - public)}"
    assert all(callable(getattr(StageWorker, n)) for n in STAGE_METHODS)
    probe = "import sys, elastic_llm.pipeline.stage_actor; print(sorted(m for m in ('torch', 'elastic_llm.pipeline.stage') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_stage_actors_front_hands_each_call_to_the_worker(monkeypatch):
    """The front passes the arguments and the answer through unchanged."""
    from elastic_llm.pipeline import stage
    from elastic_llm.pipeline.stage_actor import StageWorker

    class Worker:
        def __init__(self, *args, **kwargs):
            self.made = (args, kwargs)

        def set_width(self, *args, **kwargs):
            return ("set_width", args, kwargs)

    monkeypatch.setattr(stage, "StageWorker", Worker)
    front = StageWorker({"a": 1}, 2, replica=3)
    assert front.worker.made == (({"a": 1}, 2), {"replica": 3})
    assert front.set_width(4, dp=5) == ("set_width", (4,), {"dp": 5})


def test_every_benchmark_module_imports():
    """``elastic-llm bench X`` imports ``benchmarks.X`` only when run: a name moved in the package
    (``count_parameters`` to :mod:`elastic_llm.shape`) once broke three benchmarks with no test
    failing. One fresh process imports them all."""
    names = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module('benchmarks.' + n)\n"
    done = subprocess.run([sys.executable, "-c", code, *names], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
