"""The packages show the layers, and no import points up.

``reshard_svc`` is layered bottom-up: the base modules (errors, version, the collector
pause), then ``layout`` (pure geometry), ``storage`` (bytes at a URI), ``format`` (what the
bytes mean), ``plan`` (pure plans), ``jobs`` (the job contract: the spec and its forms, the worker's
command line, its events and environment), ``runtime`` (process groups, the executor, the
verbs) and ``sessions`` (long-lived objects over the verbs: the checkpoint manager, the
sync session). The worker (``python -m reshard_svc.worker``) and the package's
``__init__`` are on top. A module may import from its own layer and the ones below,
never above. This walks every import statement of every module: the lazy ones inside
functions and the ``TYPE_CHECKING`` ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import reshard_svc

ROOT = Path(reshard_svc.__file__).parent
LAYERS = ["layout", "storage", "format", "plan", "jobs", "runtime", "sessions"]
BASE = {"errors", "_version", "_collector", "_process"}
TOP = {"worker", "dcp"}  # `python -m reshard_svc.worker`; the package's __init__ is top too


def layer_of(module: str) -> int:
    """0 for the base modules, 1..7 for the packages, 8 for the top (by dotted name)."""
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


# ---------------------------------------------------------------- the three packages

PACKAGES = {
    "reshard_svc": ROOT,
    "reshard_server": ROOT.parent / "server" / "reshard_server",
    "reshard_client": ROOT.parent / "client" / "reshard_client",
}


def _runtime_imports(tree: ast.AST, types: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, lazy ones included; those under ``if TYPE_CHECKING:``
    (annotations only: they run nothing) only with ``types``."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not types and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom) and id(n) not in skip
    ]


def import_graph(types: bool = False) -> dict[str, set[str]]:
    """module -> the modules of the three packages it imports (``from pkg import mod``
    counts as importing ``mod``; importing a submodule does not count as importing its
    package's ``__init__``); ``types``: the ``TYPE_CHECKING`` imports too."""
    files = {}
    for top, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = [top, *path.relative_to(root).with_suffix("").parts]
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in files}
    for me, path in files.items():
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text()), types):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    kept = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(kept + ([base] if base else []))
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != me:
                    graph[me].add(name)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_package_imports_in_a_circle():
    graph = import_graph()
    assert len(graph) > 100
    assert circles(graph) == []


def test_no_circle_even_for_the_type_checker():
    """``if TYPE_CHECKING:`` imports run nothing, but a circle there is still two modules
    that each need the other to be read."""
    assert circles(import_graph(types=True)) == []


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_packages_point_one_way():
    """reshard_svc knows neither the server nor the client; the server never imports the
    client; the client uses only the server's shared request/response models."""
    wrong = []
    for me, targets in import_graph().items():
        for target in targets:
            top, other = me.split(".")[0], target.split(".")[0]
            if top == "reshard_svc" and other != "reshard_svc":
                wrong.append(f"{me} -> {target}")
            if top == "reshard_server" and other == "reshard_client":
                wrong.append(f"{me} -> {target}")
            if (
                top == "reshard_client"
                and other == "reshard_server"
                and target != "reshard_server.schemas"
            ):
                wrong.append(f"{me} -> {target}")
    assert not wrong


def test_the_cli_commands_share_one_app_and_nothing_else():
    """``reshard_client.cli``: ``_app`` imports no other part of the CLI; ``local`` and
    ``jobs`` import ``_app`` only; only the package's ``__init__`` imports them all."""
    graph = import_graph()

    def of_cli(name: str) -> bool:
        return name == "reshard_client.cli" or name.startswith("reshard_client.cli.")

    cli = {m: {t for t in ts if of_cli(t)} for m, ts in graph.items() if of_cli(m)}
    assert cli["reshard_client.cli._app"] == set()
    assert cli["reshard_client.cli.local"] == {"reshard_client.cli._app"}
    assert cli["reshard_client.cli.jobs"] == {"reshard_client.cli._app"}
    for m, ts in graph.items():
        if not of_cli(m):
            assert not {t for t in ts if of_cli(t) and t != "reshard_client.cli"}, m


def test_the_sessions_use_no_private_name_of_another_module():
    """``sessions/`` stands on the verbs' public doors: no ``_``-prefixed name imported
    from, or read off, another module of ours (its own private names are its own)."""
    wrong = []
    for path in sorted((ROOT / "sessions").rglob("*.py")):
        tree = ast.parse(path.read_text())
        ours: set[str] = set()  # names bound to modules of ours
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("reshard_svc"):
                for a in node.names:
                    if a.name.startswith("_"):
                        wrong.append(f"{path.name}:{node.lineno} imports {a.name}")
                    if _is_module(f"{node.module}.{a.name}"):
                        ours.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                ours |= {a.asname or a.name for a in node.names if a.name.startswith("reshard_svc")}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ours
                and node.attr.startswith("_")
            ):
                wrong.append(f"{path.name}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_the_sessions_reach_storage_only_through_its_protocols():
    """No ``os`` or ``shutil`` call and no fsspec filesystem (``.fs``) in ``sessions/``
    nor in the step folders of either tier (``format/steps.py``, ``format/fast.py``): they are
    :mod:`reshard_svc.format.steps`'s and :mod:`reshard_svc.format.fast`'s, bytes the
    storage protocols'."""
    wrong = []
    steps = [ROOT / "format" / "steps.py", ROOT / "format" / "fast.py"]
    for path in [*sorted((ROOT / "sessions").rglob("*.py")), *steps]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if {"os", "shutil"} & {n.split(".")[0] for n in names}:
                    wrong.append(f"{path.name}:{node.lineno} imports os/shutil")
            if isinstance(node, ast.Attribute) and node.attr == "fs":
                wrong.append(f"{path.name}:{node.lineno} reads .fs")
    assert not wrong, "\n".join(wrong)


def _code_strings(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module, docstrings left out."""
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            docs.add(id(body[0].value))
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def test_backend_file_names_are_spelled_in_storage_only():
    """What a backend names beside or inside a target (staging, replaced copies, leases
    and their debris) is written in ``storage/`` only; everyone else asks the backend."""
    names = ("staging-", "old-", "lease.json", r"lease\.json", "drop-", "taken-")
    wrong = []
    for top, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            if top == "reshard_svc" and path.is_relative_to(ROOT / "storage"):
                continue
            for node in _code_strings(ast.parse(path.read_text())):
                if any(n in node.value for n in names):
                    wrong.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.value!r}")
    assert not wrong, "\n".join(wrong)


def test_the_benches_stand_on_their_own():
    """``bench/`` imports the package and itself, never the test suite."""
    wrong = []
    for path in sorted((ROOT.parent / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            wrong += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "tests"]
    assert not wrong, "\n".join(wrong)
