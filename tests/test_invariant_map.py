"""docs/testing.md's invariant map stays true and complete.

(a) Every test the map names (``tests/test_x.py::test_name``, parameters left out) exists: its
module is a file of tests/ that defines a module-level function of that name, parametrized or not.

(b) Every *launching* test is in the map.  Decided from the sources alone (``ast``: nothing is
imported, no process starts), a test function (a module-level ``def test*`` of a
``tests/test_*.py``; this module, whose data are launcher names, aside) is launching when it
launches directly or through what it uses:

* directly: its body (the docstring aside), its default values or the arguments of its
  ``parametrize`` decorators (other decorators, such as a skip condition that looks for
  horovodrun, do not count) hold

  - a string whose first word is a launcher command: ``horovodrun``, ``mpirun``, ``mpiexec``,
    ``srun``, ``sbatch`` (``BIN / "horovodrun"``, ``["mpirun", ...]``, a page's ``sbatch ...``);
  - a string that is a runnable module of ``launch/`` (:data:`LAUNCH_MODULES`, as in
    ``[sys.executable, "-m", "launch.torch_mnist"]`` or a parametrize value), or ``"launch"``
    right after ``"-m"`` in one list, tuple or call;
  - ``BIN / "ringtrain"``: the installed console script;

* through what it uses, followed transitively: a name it reads (there too: body, defaults,
  parametrize's arguments) that the function does not bind itself (an assignment, a parameter, a
  nested ``def``, an import inside it all shadow a module's name), naming a module-level
  function, class (all its methods) or assignment of its own module, or a name imported
  (``from X import name``, at module level or inside the function) from another module of
  tests/, conftest included: conftest's ``train`` and ``launch_cmd`` name horovodrun, so what
  calls them launches; and each parameter that names a fixture (a ``@pytest.fixture`` function
  of its module, or of conftest).

What the rule cannot see: a launch made by code outside tests/ (``bench``'s entry points start
horovodrun inside bench/; a probe's own subprocesses), and a launcher named only in a runtime
value.  What it sees too much: a launcher named only as data for an in-process check, or a stand-in
script named like one; :data:`NOT_LAUNCHING` lists those tests (or a whole module), each with why,
and is checked in turn (each entry must still be flagged by the rule, else it is stale, and none
may be in the map).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

from conftest import REPO

MAP_PAGE = REPO / "docs" / "testing.md"
MAP_HEADING = "## The invariant map"
LAUNCH_COMMANDS = {"horovodrun", "mpirun", "mpiexec", "srun", "sbatch"}
LAUNCH_MODULES = {"launch.torch_mnist", "launch.tf_mnist", "launch.ray", "launch.horovodrun"}
THIS_MODULE = Path(__file__).stem  # its data are launcher names; it launches nothing
NODE_ID = re.compile(r"tests/(test_\w+)\.py::(test_\w+)(\[)?")

# Tests the rule flags that start no launcher (a node id, or a module for all its tests): each
# names one only as data, in-process, or as a stand-in script.
NOT_LAUNCHING = {
    "tests/test_ci_scripts.py":
        "the .ci scripts' refusals: every tool they would reach (horovodrun, mpirun, sbatch) is a stand-in",
    "tests/test_faults.py::test_horovodrun_across_hosts_runs_gloo_unless_told":
        "launch.horovodrun's controller choice on argv lists, in-process",
    "tests/test_horovod_tools.py::test_every_trainer_flag_passes_through_horovodrun":
        "horovodrun's own argument parser, called in-process on argv lists",
    "tests/test_multihost.py::test_horovodruns_ssh_checks_host_keys_unless_told":
        "the ssh commands horovodrun builds, and its parser, in-process",
    "tests/test_ray.py::test_kuberay_manifest_is_valid_yaml_with_a_valid_command":
        "the manifest's launch.ray entrypoint parsed in-process, not run",
    "tests/test_setup.py::test_unknown_python_is_named_in_one_line":
        "mpirun is a do-nothing stand-in that setup's tool check finds",
}

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _docless(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return body[1:]
    return body


def _names_a_launcher(node: ast.AST) -> str | None:
    """What in ``node`` itself (not its children) names a launcher, or None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        words = node.value.split()
        if node.value in LAUNCH_MODULES or (words and words[0] in LAUNCH_COMMANDS):
            return repr(node.value)
    if isinstance(node, (ast.List, ast.Tuple, ast.Call)):
        items = node.args if isinstance(node, ast.Call) else node.elts
        for a, b in zip(items, items[1:], strict=False):
            if (isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant)
                    and b.value == "launch"):
                return "'-m', 'launch'"
    if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.left, ast.Name)
            and node.left.id == "BIN" and isinstance(node.right, ast.Constant)
            and node.right.value == "ringtrain"):
        return "BIN / 'ringtrain'"
    return None


@dataclass
class Unit:
    """One module-level function, class or assignment: what it names directly, what it uses."""

    direct: str | None = None
    names: set[str] = field(default_factory=set)  # module-scope names it reads
    imports: set[tuple[str, str]] = field(default_factory=set)  # (module, name) imported inside it
    fixtures: set[str] = field(default_factory=set)  # its parameters


class Module:
    def __init__(self, source: str) -> None:
        tree = ast.parse(source)
        self.units: dict[str, Unit] = {}
        self.imported: dict[str, tuple[str, str]] = {}  # module-level ``from X import name``
        self.fixtures: set[str] = set()
        self.tests: list[str] = []
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, (*FUNCTIONS, ast.ClassDef)):
                self.units[node.name] = self._unit(node)
                if isinstance(node, FUNCTIONS):
                    if any("fixture" in ast.unparse(d) for d in node.decorator_list):
                        self.fixtures.add(node.name)
                    elif node.name.startswith("test"):
                        self.tests.append(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                unit = self._unit(node.value)
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            self.units[name.id] = unit

    @staticmethod
    def _unit(node: ast.AST) -> Unit:
        unit = Unit()
        if isinstance(node, (*FUNCTIONS, ast.ClassDef)):
            roots: list[ast.AST] = list(_docless(node.body))
            for decorator in node.decorator_list:  # parametrize's values; not skip conditions
                if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
                        and decorator.func.attr == "parametrize"):
                    roots += [*decorator.args, *(k.value for k in decorator.keywords)]
            if isinstance(node, FUNCTIONS):
                roots += [d for d in (*node.args.defaults, *node.args.kw_defaults) if d is not None]
                unit.fixtures = {a.arg for a in (*node.args.posonlyargs, *node.args.args,
                                                 *node.args.kwonlyargs)}
        else:
            roots = [node]
        inner = [sub for root in roots for sub in ast.walk(root)]
        bound = set(unit.fixtures)
        if isinstance(node, FUNCTIONS):
            bound |= {a.arg for a in (node.args.vararg, node.args.kwarg) if a}
        for sub in inner:
            if isinstance(sub, ast.Name) and not isinstance(sub.ctx, ast.Load):
                bound.add(sub.id)
            elif isinstance(sub, (*FUNCTIONS, ast.ClassDef)):
                bound.add(sub.name)
            elif isinstance(sub, ast.arg):
                bound.add(sub.arg)
            elif isinstance(sub, ast.ExceptHandler) and sub.name:
                bound.add(sub.name)
            elif isinstance(sub, ast.Import):
                bound |= {(a.asname or a.name).split(".")[0] for a in sub.names}
            elif isinstance(sub, ast.ImportFrom):
                bound |= {a.asname or a.name for a in sub.names}
                if sub.module and not sub.level:
                    unit.imports |= {(sub.module, a.name) for a in sub.names}
        for sub in inner:
            unit.direct = unit.direct or _names_a_launcher(sub)
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id not in bound:
                unit.names.add(sub.id)
        return unit


class Finder:
    """Which tests of ``sources`` (tests/ module name -> source) launch, and why."""

    def __init__(self, sources: dict[str, str]) -> None:
        self.modules = {name: Module(text) for name, text in sources.items()}

    def launching(self) -> dict[str, str]:
        """``tests/test_x.py::test_name`` -> the chain that makes it launch."""
        found = {}
        for name in sorted(self.modules):
            if name.startswith("test_") and name != THIS_MODULE:
                for test in self.modules[name].tests:
                    why = self._why(name, test, set())
                    if why:
                        found[f"tests/{name}.py::{test}"] = why
        return found

    def _why(self, module: str, name: str, seen: set[tuple[str, str]]) -> str | None:
        """Why ``name`` of ``module`` launches (the names followed, then what names a launcher)."""
        if (module, name) in seen or module not in self.modules:
            return None
        seen.add((module, name))
        mod = self.modules[module]
        if name not in mod.units:
            if name in mod.imported:
                return self._via(*mod.imported[name], seen)
            return None
        unit = mod.units[name]
        if unit.direct:
            return unit.direct
        conftest = self.modules.get("conftest")
        steps = [(used, lambda used=used: self._why(module, used, seen)) for used in sorted(unit.names)]
        steps += [(f"{m}.{n}", lambda m=m, n=n: self._why(m, n, seen)) for m, n in sorted(unit.imports)]
        for param in sorted(unit.fixtures):
            home = module if param in mod.fixtures else (
                "conftest" if conftest and param in conftest.fixtures else None)
            if home:
                steps.append((f"fixture {param}", lambda h=home, p=param: self._why(h, p, seen)))
        for label, step in steps:
            why = step()
            if why:
                return f"{label} -> {why}"
        return None

    def _via(self, module: str, name: str, seen: set[tuple[str, str]]) -> str | None:
        why = self._why(module, name, seen)
        return f"{module}.{name} -> {why}" if why else None


def suite_sources(root: Path = REPO) -> dict[str, str]:
    return {path.stem: path.read_text() for path in sorted((root / "tests").glob("*.py"))}


def map_section(text: str) -> str:
    """The map's section of the page: from its heading to the next heading of its level."""
    start = text.index(MAP_HEADING)
    end = text.find("\n## ", start + len(MAP_HEADING))
    return text[start:] if end < 0 else text[start:end]


def map_problems(section: str, sources: dict[str, str],
                 not_launching: dict[str, str] = NOT_LAUNCHING) -> list[str]:
    """What is wrong with a map: a test it names that does not exist, or names with parameters,
    a launching test it leaves out, a test it names that NOT_LAUNCHING says starts nothing."""
    finder = Finder(sources)
    named = set()
    problems = []
    for match in NODE_ID.finditer(section):
        module, test = match.group(1), match.group(2)
        node_id = f"tests/{module}.py::{test}"
        named.add(node_id)
        if match.group(3):
            problems.append(f"{node_id}: named with parameters; the map names functions")
        elif module not in sources:
            problems.append(f"{node_id}: no such module")
        elif test not in finder.modules[module].tests:
            problems.append(f"{node_id}: the module defines no test function of that name")
    launching = finder.launching()

    def exempt(node_id: str) -> bool:
        return node_id in not_launching or node_id.split("::")[0] in not_launching

    for node_id, why in launching.items():
        if not exempt(node_id) and node_id not in named:
            problems.append(f"{node_id}: launches ({why}) but the map leaves it out")
    for key in sorted(not_launching):
        if not any(node_id == key or node_id.split("::")[0] == key for node_id in launching):
            problems.append(f"{key}: listed in NOT_LAUNCHING, but the rule no longer flags it")
    for node_id in sorted(named):
        if exempt(node_id):
            problems.append(f"{node_id}: listed in NOT_LAUNCHING and in the map")
    return sorted(problems)


def test_the_invariant_map_names_real_tests_and_every_launching_test():
    assert map_problems(map_section(MAP_PAGE.read_text()), suite_sources()) == []


def test_the_rule_sees_the_launches_the_suite_is_known_for():
    """Anchors, so that a rule broken into seeing nothing fails here, not by passing."""
    launching = Finder(suite_sources()).launching()
    for node_id in ("tests/test_correctness.py::test_invariant_2_data_parallel_equals_big_batch",
                    "tests/test_torch_trainer.py::test_all_ranks_end_identical",
                    "tests/test_elastic.py::test_elastic_survives_a_killed_worker",
                    "tests/test_bad_input.py::test_bad_flags",
                    "tests/test_ray_cluster.py::test_two_nodes_train_with_identical_ranks",
                    "tests/test_slurm.py::test_documented_slurm_script_trains_two_tasks"):
        assert node_id in launching, node_id
    for node_id in ("tests/test_lr.py::test_scaling_rules",
                    "tests/test_loops.py::test_n_ranks_equal_one_process_with_n_times_the_batch",
                    "tests/test_invariant_map.py::test_the_checker_finds_what_is_missing"):
        assert node_id not in launching, node_id


FAKE_CONFTEST = '''
import pytest

def launch_cmd(module, args, np=2):
    return [str(BIN / "horovodrun"), "-np", str(np), "python", "-m", module, *args]

def train(module, args, np=2):
    return run(launch_cmd(module, args, np))

def run(cmd):
    return cmd

def horovod_ready():
    return (BIN / "horovodrun").exists()

requires_horovod = pytest.mark.skipif(not horovod_ready(), reason="no horovod")

@pytest.fixture
def hosts():
    yield None
'''

FAKE_TESTS = '''
"""horovodrun in a docstring is no launch."""
import pytest
from conftest import requires_horovod, run, train

MODULE = "launch.tf_mnist"

def helper(tmp):
    return train(tmp)

class Job:
    def start(self):
        return run(["mpirun", "-np", "2", "python", "x.py"])

@pytest.fixture
def job():
    return Job()

def test_through_a_helper(tmp_path):
    helper(tmp_path)

def test_through_a_fixture(job):
    pass

def test_through_a_constant():
    run(["python", "-m", MODULE])

@pytest.mark.parametrize("module", ["launch.torch_mnist"])
def test_through_a_parametrize_value(module):
    run(["python", "-m", module])

def test_python_m_launch():
    run(["python", "-m", "launch", "--help"])

def test_through_another_test_module():
    from test_other import Cluster
    Cluster()

@requires_horovod
def test_in_process_only():
    """horovodrun?  No: a skip condition that looks for it is no launch."""
    train = lambda x: x  # a local name shadows conftest's
    assert train(1) == 1
    assert run(["python", "-c", "pass"])

def test_with_a_fixture_of_conftest(hosts):
    pass
'''

FAKE_OTHER = '''
class Cluster:
    def __init__(self):
        self.cmd = ["sbatch --wait", "job.sh"]
'''


def test_the_checker_finds_what_is_missing():
    """The rule and the checker on a fake suite: what launches (through a helper, a fixture, a
    module constant, a parametrize value, ``-m launch``, a class of another test module) and
    what does not (a docstring, a skip condition that looks for horovodrun, a local name
    shadowing conftest's train, a conftest fixture that starts nothing); then a map that leaves a
    launching test out, names one that does not exist or names one with parameters fails, and
    so does an exemption the rule no longer needs or one the map names anyway."""
    sources = {"conftest": FAKE_CONFTEST, "test_fake": FAKE_TESTS, "test_other": FAKE_OTHER}
    launching = Finder(sources).launching()
    assert sorted(launching) == [f"tests/test_fake.py::{name}" for name in (
        "test_python_m_launch", "test_through_a_constant", "test_through_a_fixture",
        "test_through_a_helper", "test_through_a_parametrize_value",
        "test_through_another_test_module")]
    assert launching["tests/test_fake.py::test_through_a_helper"] == (
        "helper -> train -> conftest.train -> launch_cmd -> 'horovodrun'")
    assert launching["tests/test_fake.py::test_through_a_fixture"] == "fixture job -> Job -> 'mpirun'"
    assert launching["tests/test_fake.py::test_through_another_test_module"] == (
        "test_other.Cluster -> 'sbatch --wait'")
    complete = "## The invariant map\n\n" + "\n".join(f"- `{node_id}`" for node_id in launching)
    assert map_problems(complete, sources, {}) == []
    gappy = complete.replace("- `tests/test_fake.py::test_through_a_fixture`", "")
    assert map_problems(gappy, sources, {}) == [
        "tests/test_fake.py::test_through_a_fixture: launches (fixture job -> Job -> 'mpirun') "
        "but the map leaves it out"]
    wrong = complete + ("\n- `tests/test_fake.py::test_gone`, `tests/test_nowhere.py::test_x`,"
                        " `tests/test_fake.py::test_in_process_only[torch]`\n")
    assert map_problems(wrong, sources, {}) == [
        "tests/test_fake.py::test_gone: the module defines no test function of that name",
        "tests/test_fake.py::test_in_process_only: named with parameters; the map names functions",
        "tests/test_nowhere.py::test_x: no such module"]
    exempt = {"tests/test_fake.py::test_through_a_fixture": "why",
              "tests/test_fake.py::test_in_process_only": "why"}
    assert map_problems(gappy, sources, exempt) == [
        "tests/test_fake.py::test_in_process_only: listed in NOT_LAUNCHING, but the rule no longer flags it"]
    assert map_problems(complete, sources, exempt) == [
        "tests/test_fake.py::test_in_process_only: listed in NOT_LAUNCHING, but the rule no longer flags it",
        "tests/test_fake.py::test_through_a_fixture: listed in NOT_LAUNCHING and in the map"]
    whole_module = {"tests/test_fake.py": "why", "tests/test_other.py": "why"}
    assert map_problems("## The invariant map\n", sources, whole_module) == [
        "tests/test_other.py: listed in NOT_LAUNCHING, but the rule no longer flags it"]
    assert map_section(complete + "\n\n## Next\n- `tests/test_x.py::test_y`\n") == complete + "\n"
