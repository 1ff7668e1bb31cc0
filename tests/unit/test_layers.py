"""The packages show the layers, and no import points up.

``reshard_svc`` is layered bottom-up: the base modules (errors, version, the collector
pause), then ``layout`` (pure geometry), ``storage`` (bytes at a URI), ``format`` (what the
bytes mean), ``plan`` (pure plans), ``runtime`` (process groups, the executor) and ``jobs``
(the worker and its events). A module may import from its own layer and the ones below,
never above. This walks every import statement of every module: the lazy ones inside
functions and the ``TYPE_CHECKING`` ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import reshard_svc

ROOT = Path(reshard_svc.__file__).parent
LAYERS = ["layout", "storage", "format", "plan", "runtime", "jobs"]
BASE = {"errors", "_version", "_collector", "_process"}
TOP = {"worker"}  # `python -m reshard_svc.worker`; the package's __init__ is top too


def layer_of(module: str) -> int:
    """0 for the base modules, 1..6 for the packages, 7 for the top (by dotted name)."""
    parts = module.split(".")
    if parts[0] != "reshard_svc":
        raise ValueError(module)
    if len(parts) == 1 or parts[1] in TOP:
        return len(LAYERS) + 1
    if parts[1] in LAYERS:
        return LAYERS.index(parts[1]) + 1
    if parts[1] in BASE:
        return 0
    raise LookupError(f"{module}: a module outside every layer (add it to one)")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    rel = ROOT.joinpath(*dotted.split(".")[1:])
    return rel.with_suffix(".py").exists() or (rel / "__init__.py").exists()


def imports(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of every ``reshard_svc`` import in ``source`` (relative ones resolved;
    ``from package import module`` counts as importing that module)."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("reshard_svc")]
        elif isinstance(node, ast.ImportFrom):
            name = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([name] if name else []))
            if not name.startswith("reshard_svc"):
                continue
            for a in node.names:
                sub = f"{name}.{a.name}"
                out.append((node.lineno, sub if _is_module(sub) else name))
    return out


def test_every_module_sits_in_a_layer():
    for path in ROOT.rglob("*.py"):
        layer_of(module_name(path))  # raises for a module no layer owns


def test_no_import_points_up():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        me = module_name(path)
        for line, target in imports(path.read_text(), me, path.name == "__init__.py"):
            if layer_of(target) > layer_of(me):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {me} imports {target}")
    assert not wrong, "imports that point up a layer:\n" + "\n".join(wrong)


def test_the_walk_sees_lazy_relative_and_module_imports():
    source = (
        "from . import box\n"
        "def f():\n"
        "    from reshard_svc.runtime import comm\n"
        "    import reshard_svc.plan.read\n"
    )
    found = imports(source, "reshard_svc.layout.sharding", is_package=False)
    assert found == [
        (1, "reshard_svc.layout.box"),
        (3, "reshard_svc.runtime.comm"),
        (4, "reshard_svc.plan.read"),
    ]
    assert layer_of("reshard_svc.runtime.comm") > layer_of("reshard_svc.layout.sharding")


def test_the_launchers_are_engines_on_one_contract_with_no_circle():
    """``reshard_server.launchers``: ``base`` holds the contract and imports no other part
    of the server; each engine module imports the contract (and the settings), never the
    package or another engine; only the package's ``__init__`` (the factory) knows them all."""
    import reshard_server.launchers as launchers

    root = Path(launchers.__file__).parent
    seen = {}
    for path in sorted(root.glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        seen[path.stem] = {n for n in names if n.startswith("reshard_server")}
    assert {"base", "local", "slurm", "kubernetes"} <= set(seen)
    assert seen["base"] == set()
    for engine in set(seen) - {"base", "__init__"}:
        assert seen[engine] <= {"reshard_server.launchers.base", "reshard_server.config"}, engine


def test_the_worker_environment_is_spelled_once():
    """Every ``RESHARD_*`` variable a worker is handed is written as a string in
    ``reshard_svc/jobs/environment.py`` only; the launchers, the CLI's runner, the worker
    and the events import the names."""
    import reshard_client
    import reshard_server
    from reshard_svc.jobs import environment

    names = {v for k, v in vars(environment).items() if k.endswith("_ENV")}
    assert "RESHARD_JOB_ID" in names and len(names) >= 6
    roots = [ROOT, Path(reshard_server.__file__).parent, Path(reshard_client.__file__).parent]
    spelled = []
    for root in roots:
        for path in root.rglob("*.py"):
            if path == Path(environment.__file__):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in names:
                    spelled.append(f"{path.name}:{node.lineno} {node.value}")
    assert spelled == []
