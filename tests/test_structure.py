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

    With ``dynamic``, a string literal that names a first-party module counts as an import too:
    that is how the dispatcher reaches the trainers (``importlib.import_module(TRAINERS[...])``)
    and the dataset registry its datasets, and how a runtime cycle would hide from the others.
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
            elif dynamic and isinstance(node, ast.Constant) and node.value in files:
                targets = [node.value]
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


def test_no_import_cycles():
    graph = first_party_imports()
    assert {"launch.dispatch", "torch_models.train", "torch_models.elastic", "tf_models.train",
            "tf_models.elastic", "ringtrain.training.fixed"} <= set(graph)
    assert {"torch_models.train", "tf_models.elastic"} <= graph["launch.dispatch"], \
        "the dispatcher's dynamic imports are not seen"
    assert cycles(graph) == []


def test_the_cycle_check_sees_a_cycle_through_the_dispatcher():
    """What the layout removed: the library calling the dispatcher, which imports the trainers by
    name, which import the library."""
    graph = first_party_imports()
    graph["ringtrain.training.fixed"] = graph["ringtrain.training.fixed"] | {"launch.dispatch"}
    assert any("launch.dispatch" in c and "ringtrain.training.fixed" in c for c in cycles(graph))


def test_layers():
    """``ringtrain`` is the library and imports no command or trainer; ``launch`` (the commands)
    imports the library and reaches the trainers only by name (launch/dispatch.py); each
    framework's package uses the library and leaves the commands and the other framework alone:
    one framework's Horovod per process."""
    static = first_party_imports(dynamic=False)
    for module, deps in first_party_imports().items():
        top = module.split(".")[0]
        tops = {d.split(".")[0] for d in deps}
        if top == "ringtrain":
            assert tops <= {"ringtrain"}, (module, deps)
        elif top == "launch":
            assert {d.split(".")[0] for d in static[module]} <= {"launch", "ringtrain"}, (module, deps)
        else:
            assert tops <= {top, "ringtrain"}, (module, deps)


def test_command_line_checks_import_no_framework():
    """Flags, --model syntax included, are checked before any framework is imported."""
    code = ("import sys, launch.__main__, launch.torch_mnist, launch.tf_mnist, launch.cli, "
            "ringtrain.flags, ringtrain.training.fixed, ringtrain.training.elastic; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'horovod') if m in sys.modules))")
    proc = run([sys.executable, "-c", code])
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


TRAINERS = ("torch_models/run.py", "torch_models/train.py", "torch_models/elastic.py",
            "tf_models/run.py", "tf_models/train.py", "tf_models/elastic.py",
            "torch_models/pipeline.py", "tf_models/pipeline.py")


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


@pytest.mark.parametrize("run_file", ["torch_models/run.py", "tf_models/run.py",
                                      "torch_models/pipeline.py", "tf_models/pipeline.py"])
def test_the_horovod_steps_are_marked_within_one_screen(run_file):
    """Horovod's recipe, as its own examples show it: initialise, pin, scale the LR, wrap the
    optimizer, broadcast, together in the run object; the shard is the shared loops'."""
    def marks(path):
        found = {}
        for number, line in enumerate((REPO / path).read_text().splitlines()):
            m = re.search(r"# Horovod: (\w+)", line)
            if m:
                found.setdefault(m.group(1), number)
        return found

    steps = ("initialise", "pin", "scale", "wrap", "broadcast")
    found = marks(run_file)
    assert set(steps) <= set(found), found
    span = max(found[s] for s in steps) - min(found[s] for s in steps)
    assert span <= 60, f"the Horovod lines of {run_file} span {span} lines"
    for loop in ("ringtrain/training/fixed.py", "ringtrain/training/elastic.py"):
        assert "shard" in marks(loop), loop
