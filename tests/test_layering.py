"""The package's layering, its public line, and where Ray's and torch's internals may be used.

Every import of every module counts, function-level and ``TYPE_CHECKING`` ones included (parsed,
not executed). The layers, bottom up (README, "How it fits together"):

- base: ``_ray_internals`` (every private Ray API), ``_torch_internals`` (every private torch
  API), ``_lazy``, ``storage`` (a path or URI to a filesystem, a run's storage), ``faults``,
  ``tracking``, ``lifecycle`` (the points of an attempt the checkpoint loop announces, which the
  watchdog and spare workers plug into);
- ``data`` and ``goodput``, which know nothing of each other or of checkpoints;
- ``spare_workers``, then ``watchdog`` (hang detection, which records into the goodput ledger and
  starts its actor with the spare workers' runtime environment);
  then ``checkpoint``, which feeds the goodput ledger; then ``survivors``
  (survivor mode), which writes its checkpoints with ``checkpoint``'s parts and judges its
  replicas' silence by ``watchdog``'s rule;
- the front: ``console`` (what a run prints), ``ray_config``, ``connect`` (a driver's
  ``ray.init``), ``status`` (where a run stands), ``cli``, the package's lazy ``__init__``;
  beside it ``testing``, the rig.

Outside the package (Python embedded in shell scripts included) only public names are used, each of
a tier its folder may use (:data:`OUTSIDE`). The tiers: stable, the ``__all__`` of each module of
:data:`PUBLIC`; developer, its ``DEVELOPER``, for code that extends the library (may change between
minor versions); kit, every name of :data:`KIT`, the experiment kit (unstable). Jobs, examples,
notebooks, cluster and scripts, which users read and copy, use stable names only; benchmarks all
three (their baselines build on developer names, their plumbing is the kit). No folder here takes
developer names without the kit: they are for code of yours that extends the library. Tests may use
anything, internals included. Across the whole repository, tests included, Ray's internals are touched only by
``_ray_internals`` and torch's only by ``_torch_internals`` (and each wall's own test).
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import ray_resilient

PACKAGE = Path(ray_resilient.__file__).resolve().parent
REPO = PACKAGE.parent
TESTS = Path(__file__).resolve().parent
BASE = {"_ray_internals", "_torch_internals", "_lazy", "storage", "faults", "tracking", "lifecycle"}
ALLOWED = {
    "lifecycle": {"storage"},
    "_ray_internals": set(),
    "_torch_internals": set(),
    "_lazy": set(),
    "faults": set(),
    "tracking": set(),
    "storage": {"_ray_internals", "_lazy"},
    "data": BASE,
    "goodput": BASE,
    "spare_workers": BASE,
    "watchdog": BASE | {"goodput", "spare_workers"},
    "checkpoint": BASE | {"goodput", "spare_workers", "watchdog"},
    "survivors": BASE | {"checkpoint", "goodput", "spare_workers", "watchdog"},
    "console": set(),
    "ray_config": BASE | {"checkpoint", "console", "goodput", "spare_workers", "survivors"},
    "connect": set(),
    "status": BASE | {"checkpoint", "goodput"},
    "cli": BASE | {"checkpoint", "goodput", "status"},
    "__init__": BASE | {"checkpoint", "ray_config", "connect", "spare_workers"},
    "testing": BASE | {"checkpoint", "data", "goodput", "spare_workers", "survivors", "ray_config"},
}
# The public line: these modules' ``__all__`` and ``DEVELOPER`` names; everything else in the package is internal.
PUBLIC = ("ray_resilient", "ray_resilient.checkpoint", "ray_resilient.data", "ray_resilient.goodput",
          "ray_resilient.storage", "ray_resilient.survivors", "ray_resilient.testing", "ray_resilient.testing.kit",
          "ray_resilient.tracking", "ray_resilient.watchdog")
KIT = "ray_resilient.testing.kit"  # its ``__all__`` is the kit tier, not stable
OUTSIDE = {  # code that uses the package, and the tiers of names it may use
    "jobs": {"stable"},
    "examples": {"stable"},
    "notebooks": {"stable"},
    "cluster": {"stable"},
    "scripts": {"stable"},
    "benchmarks": {"stable", "developer", "kit"},
}
SCANNED = ("ray_resilient", "tests", *OUTSIDE)  # the whole repository's code

RAY_DEVELOPER_APIS = {"get_storage", "has_replica_groups"}  # DeveloperAPIs of Ray Train we use
RAY_WALL = {PACKAGE / "_ray_internals.py", TESTS / "test_ray_internals.py"}
# Private torch attributes and names that no module path shows (they hang off objects, or are strings).
TORCH_PRIVATE_NAMES = {"_local_tensor", "_get_metadata_path", "_Options", "_orig_mod", "_StorageInfo", "_get_layout"}
TORCH_WALL = {PACKAGE / "_torch_internals.py", TESTS / "test_torch_internals.py"}
RAY_INTERNAL_TEXT = re.compile(
    r"\bray(?:\.\w+)*\._(?!_)\w*|\bray\.core\.generated|\bget_storage\(|\bhas_replica_groups\b")
TORCH_INTERNAL_TEXT = re.compile(r"\btorch(?:\.\w+)*\._(?!_)\w*")
SHELL_PYTHON = re.compile(r"python3?\S*\s+-\s*<<-?\s*'?(\w+)'?\n(.*?)\n\1\n|python3?\S*\s+-c\s+(['\"])(.*?)\3", re.S)
SHELL_MODULE = re.compile(r"-m\s+(ray_resilient[\w.]*)")


def part(module: str) -> str:
    """``ray_resilient.checkpoint.writer`` -> ``checkpoint``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> set[str]:
    """The absolute names of every module ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(REPO).with_suffix("")
        name = ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)
        found[name] = path
    return found


def test_every_part_of_the_package_has_a_layer():
    assert {part(m) for m in modules()} <= set(ALLOWED)


@pytest.mark.parametrize("module", sorted(modules()))
def test_each_module_imports_only_the_parts_below_it(module):
    mine = part(module)
    wrong = sorted(
        name for name in imports(modules()[module])
        if name.startswith("ray_resilient.") and part(name) not in ALLOWED[mine] | {mine}
    )
    assert not wrong, f"{module} ({mine}) may import only {sorted(ALLOWED[mine])}, imports {wrong}"


# --- Code as the scans see it -----------------------------------------------------------------

def code_files(top: str) -> Iterator[Path]:
    """The files with code under ``top`` (a folder of the repository), caches and builds left out."""
    for path in sorted((REPO / top).rglob("*")):
        if path.is_file() and not any(p.startswith(".") or p == "__pycache__" for p in path.relative_to(REPO).parts):
            if path.suffix in {".py", ".ipynb", ".sh", ".yaml", ".yml"} or path.name == "Dockerfile":
                yield path


def python_sources(path: Path) -> list[tuple[str, int]]:
    """The Python in ``path`` as (source, first line): a module, a notebook's code cells (magics and
    shell lines left out), or what a shell script runs with ``python -c`` or ``python - <<EOF``."""
    text = path.read_text()
    if path.suffix == ".py":
        return [(text, 1)]
    if path.suffix == ".ipynb":
        cells = ["".join(cell["source"]) for cell in json.loads(text)["cells"] if cell["cell_type"] == "code"]
        return [("\n".join(line for line in cell.splitlines() if not line.lstrip().startswith(("%", "!"))), 1)
                for cell in cells]
    if path.suffix == ".sh":
        groups = [(match, 2 if match[2] is not None else 4) for match in SHELL_PYTHON.finditer(text)]
        return [(match[group], text[:match.start(group)].count("\n") + 1) for match, group in groups]
    return []


def references(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(dotted name, line) of every module and module attribute ``tree`` names: each import, and
    each attribute chain on a name an import bound (``dist.ProcessGroupGloo._Options`` with
    ``import torch.distributed as dist`` is ``torch.distributed.ProcessGroupGloo._Options``)."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]  # `import a.b` binds `a`; `import a.b as c` binds `c` to a.b
                bound[alias.asname or top] = alias.name if alias.asname else top
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module, node.lineno
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                yield f"{node.module}.{alias.name}", node.lineno
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, root = [node.attr], node.value
            while isinstance(root, ast.Attribute):
                chain.insert(0, root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                yield ".".join([bound[root.id], *chain]), node.lineno


def identifiers(tree: ast.AST) -> Iterator[tuple[str, int]]:
    """(identifier, line) of every attribute and name used or assigned, and every string constant."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value, node.lineno


def private_references(tree: ast.AST, root: str, also: tuple[str, ...] = ()) -> Iterator[tuple[int, str]]:
    """(line, module) of each private module of ``root`` that ``tree`` refers to, once: the name up
    to its first ``_private`` part (dunders are public), or one of the packages in ``also``."""
    seen = set()
    for name, line in references(tree):
        parts = name.split(".")
        first = next((i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__")), None)
        private = next((p for p in also if name.startswith(p)), None)
        if parts[0] == root and first is not None:
            private = ".".join(parts[:first + 1])
        if private and private not in seen:
            seen.add(private)
            yield line, private


def scan(top: str, offences) -> list[str]:
    """``path:line: what`` for each (line, what) that ``offences(path, tree)`` finds in the code under ``top``."""
    found: list[str] = []
    for path in code_files(top):
        if path == TESTS / Path(__file__).name:  # the scanner names what it looks for
            continue
        for source, first in python_sources(path):
            tree = ast.parse(source, str(path))
            lines = sorted(set(offences(path, tree)))
            found += [f"{path.relative_to(REPO)}:{line + first - 1}: {what}" for line, what in lines]
    return found


# --- The public line --------------------------------------------------------------------------

def tiers(module: str) -> dict[str, str]:
    """{name: tier} of the public ``module``."""
    package = importlib.import_module(module)
    listed = "kit" if module == KIT else "stable"
    return {**dict.fromkeys(getattr(package, "DEVELOPER", ()), "developer"), **dict.fromkeys(package.__all__, listed)}


def misuse(name: str, top: str) -> str | None:
    """Why the dotted ``ray_resilient...`` name (a module, or a name in one) may not be used under
    ``top``, or None. An attribute chain past a public name (a method, a field) is that name's business."""
    parts = name.split(".")
    owner = max((".".join(parts[:n]) for n in range(1, len(parts) + 1) if ".".join(parts[:n]) in PUBLIC), key=len)
    if owner == name:
        tier = "kit" if name == KIT else "stable"
    else:
        attribute = parts[owner.count(".") + 1]
        name, tier = f"{owner}.{attribute}", tiers(owner).get(attribute)
        if tier is None:
            return f"{attribute} is not in {owner}.__all__ or its DEVELOPER"
    allowed = OUTSIDE[top]
    if tier not in allowed:
        return f"{name} is {tier} API; {top}/ may use {' or '.join(sorted(allowed))} names only"
    return None


def tier_offences(top: str, tree: ast.AST) -> Iterator[tuple[int, str]]:
    """Each name ``tree`` uses that code under ``top`` may not, once (at its import, not again at each use)."""
    seen = set()
    for name, line in references(tree):
        if name == "ray_resilient" or name.startswith("ray_resilient."):
            problem = misuse(name, top)
            if problem and problem not in seen:
                seen.add(problem)
                yield line, problem


@pytest.mark.parametrize("top", OUTSIDE)
def test_code_outside_the_package_uses_only_the_tiers_it_may(top):
    """Jobs, benchmarks, notebooks, examples and cluster scripts use ``ray_resilient`` as users do:
    what they need and the package lacks becomes public API (README, "How it fits together"), and
    what users read and copy needs only stable names."""
    offenders = scan(top, lambda path, tree: tier_offences(top, tree))
    for path in code_files(top):
        if path.suffix == ".sh":
            offenders += [f"{path.relative_to(REPO)}: python -m {module}: {problem}"
                          for module in SHELL_MODULE.findall(path.read_text()) if (problem := misuse(module, top))]
    assert not offenders, "\n".join(offenders)


def test_the_public_modules_export_what_they_list():
    for module in PUBLIC:
        package = importlib.import_module(module)
        for name in tiers(module):
            assert getattr(package, name) is not None, f"{module}.{name}"


def test_each_public_name_has_one_tier():
    """Listed once in its module (in ``__all__`` or ``DEVELOPER``), and alike in every module that exports it."""
    found: dict[str, set[str]] = {}
    for module in PUBLIC:
        package = importlib.import_module(module)
        listed = [*package.__all__, *getattr(package, "DEVELOPER", ())]
        assert len(listed) == len(set(listed)), f"{module} lists a name twice"
        for name, tier in tiers(module).items():
            found.setdefault(name, set()).add(tier)
    assert not {name: kinds for name, kinds in found.items() if len(kinds) > 1}


@pytest.mark.parametrize("module", [m for m in PUBLIC if hasattr(importlib.import_module(m), "_EXPORTS")])
def test_a_lazy_package_shows_its_real_edges_to_tools(module):
    """Each lazy ``__init__`` imports its exports under ``TYPE_CHECKING``, exactly, so readers and
    type checkers see where each name comes from."""
    package = importlib.import_module(module)
    exports = package._EXPORTS | getattr(package, "DEVELOPER", {})
    exported = {(f"{module}.{source}", name) for name, source in exports.items()}
    tree = ast.parse(Path(package.__file__).read_text())
    guarded = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    imported = {(node.module, alias.name) for block in guarded for node in ast.walk(block)
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert imported == exported


# --- The walls --------------------------------------------------------------------------------

def ray_offences(path: Path, tree: ast.AST) -> Iterator[tuple[int, str]]:
    if path in RAY_WALL:
        return
    yield from private_references(tree, "ray", also=("ray.core.generated",))
    for name, line in identifiers(tree):
        if name in RAY_DEVELOPER_APIS:
            yield line, f"{name} (a Ray DeveloperAPI)"


def torch_offences(path: Path, tree: ast.AST) -> Iterator[tuple[int, str]]:
    if path in TORCH_WALL:
        return
    yield from private_references(tree, "torch")
    for name, line in identifiers(tree):
        if name.split(".")[0] in TORCH_PRIVATE_NAMES:
            yield line, f"{name} (private to torch)"


def text_offences(top: str, pattern: re.Pattern) -> list[str]:
    """Matches of ``pattern`` in the shell scripts and configs under ``top`` (their Python is parsed)."""
    return [f"{path.relative_to(REPO)}: {match[0]}" for path in code_files(top)
            if path.suffix in {".sh", ".yaml", ".yml"} or path.name == "Dockerfile"
            for match in pattern.finditer(path.read_text())]


@pytest.mark.parametrize("top", SCANNED)
def test_only_the_wall_touches_ray_internals(top):
    """Private Ray modules (``_private``, ``_internal``, ``_raylet``, any underscore module,
    ``ray.core.generated``) and the DeveloperAPIs we use (``get_storage()``,
    ``has_replica_groups``) appear in ``ray_resilient._ray_internals`` alone, and in its test
    (tests/test_ray_internals.py checks each of them); everything else goes through the wall."""
    offenders = scan(top, ray_offences) + text_offences(top, RAY_INTERNAL_TEXT)
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("top", SCANNED)
def test_only_the_wall_touches_torch_internals(top):
    """Private torch modules and names appear in ``ray_resilient._torch_internals`` alone, and in
    its test (tests/test_torch_internals.py checks each of them on every supported torch)."""
    offenders = scan(top, torch_offences) + text_offences(top, TORCH_INTERNAL_TEXT)
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("module", ["ray_resilient", "ray_resilient.data.download_process", "ray_resilient.cli"])
def test_light_modules_import_neither_torch_nor_ray(module):
    """The lazy package lets the download child and the command line start without torch or Ray."""
    code = f"import sys, {module}; print(sorted({{'torch', 'ray', 'mlflow'}} & set(sys.modules)))"
    heavy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert heavy == "[]"
