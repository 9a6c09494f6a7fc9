"""The package's shape: no import cycles, the launcher free of frameworks, the Horovod lines marked.

Read from the sources (every ``import``, at any depth, function-level ones included), so a cycle
hidden inside a function body counts too.
"""

from __future__ import annotations

import ast
import re
import sys

import pytest
from conftest import REPO, run

PACKAGES = ("ringtrain", "launch", "torch_models", "tf_models")


def module_name(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def first_party_imports(dynamic: bool = True) -> dict[str, set[str]]:
    """module -> the first-party modules it imports (``from pkg import mod`` names ``pkg.mod``).

    With ``dynamic``, a string literal that names a first-party module (or ``module:attribute``)
    counts as an import too: that is how the strategy registry reaches the run objects
    (``"torch_models.run:TorchRun"``) and the dataset registry its datasets, and how a runtime
    cycle would hide from the others.
    """
    files = {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files
                           else node.module for a in node.names]
            elif (dynamic and isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value.split(":")[0] in files):
                targets = [node.value.split(":")[0]]
            else:
                continue
            deps.update(t for t in targets if t.split(".")[0] in PACKAGES and t != name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


REGISTRY = "ringtrain.strategies.registry"


def test_no_import_cycles():
    graph = first_party_imports()
    assert {REGISTRY, "torch_models.run", "torch_models.elastic", "tf_models.run",
            "tf_models.elastic", "ringtrain.training.fixed_loop"} <= set(graph)
    assert {"torch_models.run", "torch_models.pipeline", "tf_models.ps",
            "tf_models.elastic"} <= graph[REGISTRY], "the registry's dynamic imports are not seen"
    assert cycles(graph) == []


def test_the_cycle_check_sees_a_cycle_through_the_registry():
    """What the layout rules out: a library module below the registry calling it (the registry
    names the run objects, which import the library)."""
    graph = first_party_imports()
    graph["ringtrain.training.startup"] = graph["ringtrain.training.startup"] | {REGISTRY}
    assert any(REGISTRY in c and "ringtrain.training.startup" in c for c in cycles(graph))


def test_layers():
    """``ringtrain`` is the library and imports no command; it names the framework packages' run
    objects in one place only, the strategy registry, by name (one framework's Horovod per
    process); ``launch`` (the commands) imports the library; each framework's package uses the
    library and leaves the commands and the other framework alone."""
    static = first_party_imports(dynamic=False)
    for module, deps in first_party_imports().items():
        top = module.split(".")[0]
        tops = {d.split(".")[0] for d in deps}
        if top == "ringtrain":
            assert {d.split(".")[0] for d in static[module]} <= {"ringtrain"}, (module, deps)
            allowed = {"ringtrain", "torch_models", "tf_models"} if module == REGISTRY else {"ringtrain"}
            assert tops <= allowed, (module, deps)
        elif top == "launch":
            assert {d.split(".")[0] for d in static[module]} <= {"launch", "ringtrain"}, (module, deps)
        else:
            assert tops <= {top, "ringtrain"}, (module, deps)


def test_command_line_checks_import_no_framework():
    """Flags, --model syntax included, are checked before any framework is imported."""
    code = ("import sys, launch.__main__, launch.torch_mnist, launch.tf_mnist, launch.cli, "
            "ringtrain.flags, ringtrain.training.fixed_loop, ringtrain.training.elastic, "
            "ringtrain.strategies.registry, launch.ray; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'horovod') if m in sys.modules))")
    proc = run([sys.executable, "-c", code])
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


TRAINERS = tuple(f"{fw}_models/{name}.py" for fw in ("torch", "tf")
                 for name in ("startup", "run", "elastic", "pipeline", "ps"))


def horovod_names(tree: ast.Module) -> set[str]:
    """The names a module binds to Horovod: its modules (``hvd``, ``hvd_keras``) and what it
    imports from them (``run_fn``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name.startswith("horovod")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("horovod"):
            names |= {a.asname or a.name for a in node.names}
    return names


def horovod_calls(tree: ast.Module) -> list[tuple[int, str]]:
    """(first line of the statement, the call) of every call into Horovod, and of every decorator
    that is Horovod's (``@hvd.elastic.run``)."""
    names = horovod_names(tree)

    def root(node) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def statement_line(node) -> int:
        while not isinstance(node, ast.stmt):
            child, node = node, parents[node]
            if child in getattr(node, "decorator_list", ()):
                return child.lineno
        return node.lineno

    found = []
    for node in ast.walk(tree):
        decorators = [d for d in getattr(node, "decorator_list", ()) if root(d) in names]
        found += [(d.lineno, ast.unparse(d)) for d in decorators]
        if isinstance(node, ast.Call) and root(node.func) in names and node.func not in decorators:
            found.append((statement_line(node), ast.unparse(node.func)))
    return sorted(set(found))


def marked(lines: list[str], first: int, calls: set[int] = frozenset()) -> bool:
    """Line ``first`` (1-based) carries ``# Horovod:``, or the comment block right above it does,
    or it follows a marked Horovod call on the line before (one comment for a group of calls, as
    Horovod's examples mark ``broadcast_parameters`` and ``broadcast_optimizer_state``)."""
    if "# Horovod:" in lines[first - 1]:
        return True
    i = first - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        if "# Horovod:" in lines[i]:
            return True
        i -= 1
    return first - 1 in calls and marked(lines, first - 1, calls)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_horovod_call_in_a_trainer_is_marked(trainer):
    text = (REPO / trainer).read_text()
    lines = text.splitlines()
    calls = horovod_calls(ast.parse(text))
    lines_with_calls = {line for line, _ in calls}
    unmarked = [(line, call) for line, call in calls if not marked(lines, line, lines_with_calls)]
    assert not unmarked, f"{trainer}: Horovod calls without a '# Horovod:' comment: {unmarked}"


def test_the_mark_check_sees_an_unmarked_call():
    code = "import horovod.torch as hvd\n# Horovod: initialise\nhvd.init()\nx = hvd.rank()\n"
    calls = horovod_calls(ast.parse(code))
    assert calls == [(3, "hvd.init"), (4, "hvd.rank")]
    assert [marked(code.splitlines(), line) for line, _ in calls] == [True, False]


def marks(path: str) -> dict[str, int]:
    """The first line (0-based) of each ``# Horovod: <step>`` comment in ``path``."""
    found = {}
    for number, line in enumerate((REPO / path).read_text().splitlines()):
        m = re.search(r"# Horovod: (\w+)", line)
        if m:
            found.setdefault(m.group(1), number)
    return found


@pytest.mark.parametrize("run_file", ["torch_models/run.py", "tf_models/run.py",
                                      "torch_models/pipeline.py", "tf_models/pipeline.py"])
def test_the_horovod_steps_are_marked_within_one_screen(run_file):
    """Horovod's recipe, as its own examples show it: initialise and pin in the framework's one
    start-up (``startup.py``, which every strategy calls), then scale the LR, wrap the optimizer
    and broadcast together in the strategy's run object; the shard is the shared loops'."""
    start = marks(f"{run_file.split('/')[0]}/startup.py")
    assert {"initialise", "pin"} <= set(start), start
    assert abs(start["pin"] - start["initialise"]) <= 10, start
    steps = ("scale", "wrap", "broadcast")
    found = marks(run_file)
    assert set(steps) <= set(found), found
    span = max(found[s] for s in steps) - min(found[s] for s in steps)
    assert span <= 60, f"the Horovod lines of {run_file} span {span} lines"
    for loop in ("ringtrain/training/fixed_loop.py", "ringtrain/training/elastic.py"):
        assert "shard" in marks(loop), loop


def horovod_init_calls() -> list[tuple[str, int]]:
    """(file, line) of every ``hvd.init(...)`` call in the packages (Horovod's module bound to any
    name), comments and strings aside."""
    found = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            names = horovod_names(tree)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "init" and isinstance(node.func.value, ast.Name)
                        and node.func.value.id in names):
                    found.append((str(path.relative_to(REPO)), node.lineno))
    return found


def test_horovod_is_initialised_in_one_start_up_per_framework():
    """Every strategy composes its framework's start-up: ``hvd.init`` is called in
    ``torch_models/startup.py`` and ``tf_models/startup.py`` only, once each (the TF elastic
    job's re-join goes through the same call)."""
    calls = horovod_init_calls()
    assert sorted(f for f, _ in calls) == ["tf_models/startup.py", "torch_models/startup.py"], calls


def test_the_option_parser_imports_no_strategy():
    """The shared flags (``ringtrain.flags``) know no strategy: each strategy's flags are its
    package's, put together by the registry."""
    deps = first_party_imports()["ringtrain.flags"]
    assert not {d for d in deps if d.startswith("ringtrain.strategies")}, deps
