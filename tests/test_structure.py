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


@pytest.mark.parametrize("trainer", ["torch_models/train.py", "tf_models/train.py"])
def test_the_six_horovod_steps_are_marked_within_one_screen(trainer):
    lines = (REPO / trainer).read_text().splitlines()
    marks = {}
    for number, line in enumerate(lines):
        m = re.search(r"# Horovod: (\w+)", line)
        if m:
            marks.setdefault(m.group(1), number)
    steps = ("initialise", "pin", "scale", "broadcast", "wrap", "shard")
    assert set(steps) <= set(marks), marks
    span = max(marks[s] for s in steps) - min(marks[s] for s in steps)
    assert span <= 60, f"the Horovod lines of {trainer} span {span} lines"
