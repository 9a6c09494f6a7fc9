"""docs/architecture.md cannot drift: its tree against the folders and modules on disk, its seam
table against the run object's public members, its packages table against every module."""

from __future__ import annotations

import re

from conftest import REPO

from ringtrain.training.run import FrameworkRun

PAGE = REPO / "docs" / "architecture.md"
PACKAGES = ("launch", "ringtrain", "torch_models", "tf_models")


def page() -> str:
    return PAGE.read_text()


def tree_block(text: str) -> str:
    return text.split("```", 2)[1]


def table(text: str, header: str) -> list[list[str]]:
    """The rows (cells) of the markdown table whose header row starts with ``header``."""
    lines = text[text.index(header):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def ticked(cell: str) -> set[str]:
    """The names in backticks in ``cell``, a call's parentheses dropped."""
    return {re.sub(r"\(.*", "", name) for name in re.findall(r"`([^`]+)`", cell)}


def seam_members() -> set[str]:
    return ({n for n in dir(FrameworkRun) if not n.startswith("_")}
            | set(FrameworkRun.__annotations__))


def documented_seam(text: str) -> set[str]:
    return set().union(*(ticked(row[0]) for row in table(text, "| member | what it does |")))


def test_the_seam_table_is_the_run_objects_public_members():
    documented, members = documented_seam(page()), seam_members()
    assert documented == members, (f"documented but not on FrameworkRun: {documented - members}; "
                                   f"on FrameworkRun but not in the table: {members - documented}")


def test_the_seam_check_sees_a_missing_row():
    text = page()
    row = next(line for line in text.splitlines() if line.startswith("| `problem` |"))
    assert documented_seam(text.replace(row + "\n", "")) != seam_members()


def library_folders() -> set[str]:
    """ringtrain's packages one level down (``strategies/``, ``training/``...)."""
    return {p.parent.name for p in (REPO / "ringtrain").glob("*/__init__.py")}


def test_the_tree_names_every_folder_and_top_level_module():
    block = tree_block(page())
    listed = set(re.findall(r"^  (\w+)/", block, re.M))
    assert listed == library_folders(), (listed, library_folders())
    for top in PACKAGES:
        assert re.search(rf"(^|\s){top}/", block, re.M), top
    modules = {p.name for p in (REPO / "ringtrain").glob("*.py") if p.name != "__init__.py"}
    files = {name for line in block.splitlines() if re.match(r"^  \w+\.py", line)
             for name in re.findall(r"\b(\w+\.py)\b", line)}
    assert modules <= files, modules - files
    assert files <= modules, f"the tree names modules that are gone: {files - modules}"


def documented_modules(text: str) -> set[str]:
    """``package.module`` of every module the packages table names (a row without a package
    continues the one above; ``torch_models``, ``tf_models`` share rows; ``(TF)`` marks a module
    of tf_models alone, ``(PyTorch)`` one of torch_models alone)."""
    found, packages = set(), []
    for cells in table(text, "| package | module | its one job |"):
        if cells[0]:
            packages = sorted(ticked(cells[0]))
        for name in ticked(cells[1]):
            for package in packages:
                found.add(f"{package}.{name.removesuffix('.sh')}")
    return found


def modules_on_disk() -> set[str]:
    found = set()
    for top in PACKAGES:
        for path in (REPO / top).rglob("*.py"):
            if path.name == "__init__.py" or "__pycache__" in path.parts:
                continue
            found.add(".".join(path.relative_to(REPO).with_suffix("").parts))
    return found


def test_the_packages_table_names_every_module():
    documented, on_disk = documented_modules(page()), modules_on_disk()
    missing = on_disk - documented
    assert not missing, f"modules the packages table of docs/architecture.md does not name: {missing}"
    # every module it names exists (a shared row names a TF-only module for torch_models too,
    # and a PyTorch-only one for tf_models)
    twin = {"torch_models": "tf_models", "tf_models": "torch_models"}
    gone = {m for m in documented - on_disk
            if not (m.split(".", 1)[0] in twin
                    and f"{twin[m.split('.', 1)[0]]}.{m.split('.', 1)[1]}" in on_disk)
            and not m.endswith("discover_hosts")}
    assert not gone, f"the packages table names modules that are gone: {gone}"


def test_the_modules_check_sees_a_new_module():
    assert "ringtrain.strategies.newone" not in documented_modules(page())
    assert {"ringtrain.strategies.registry", "torch_models.startup"} <= documented_modules(page())
