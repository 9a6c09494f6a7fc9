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


def first_party_imports() -> dict[str, set[str]]:
    """module -> the first-party modules it imports (``from pkg import mod`` names ``pkg.mod``)."""
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
    assert {"ringtrain.training.job", "torch_models.train", "torch_models.elastic", "tf_models.train",
            "tf_models.elastic"} <= set(graph)
    assert cycles(graph) == []


def test_layers():
    """``launch`` reaches the trainers only by name (launch/dispatch.py), and each framework's
    package leaves the other alone: one framework's Horovod per process."""
    graph = first_party_imports()
    for module, deps in graph.items():
        top = module.split(".")[0]
        if top == "ringtrain":
            assert not {d for d in deps if not d.startswith("ringtrain")}, (module, deps)
        elif top == "launch":
            assert not {d for d in deps if d.split(".")[0] not in ("launch", "ringtrain")}, (module, deps)
        else:
            other = "tf_models" if top == "torch_models" else "torch_models"
            assert not {d for d in deps if d.startswith(other)}, (module, deps)


def test_command_line_checks_import_no_framework():
    """Flags, --model syntax included, are checked before any framework is imported."""
    code = ("import sys, launch.__main__, launch.torch_mnist, launch.tf_mnist, ringtrain.training.job; "
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
