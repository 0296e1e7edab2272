"""The package's layering: which part may import which, and where Ray's internals may be used.

Every import of every module counts, function-level ones included (parsed, not executed). The
layers, bottom up (README, "How it fits together"):

- base: ``_ray_internals`` (every private Ray API), ``_lazy``, ``storage`` (a path or URI to a
  filesystem, a run's storage), ``faults``, ``tracking``;
- ``data`` and ``goodput``, which know nothing of each other or of checkpoints;
- ``spare_workers``; then ``checkpoint``, which feeds the goodput ledger; then ``survivors``
  (survivor mode), which writes its checkpoints with ``checkpoint``'s parts;
- the front: ``ray_config``, ``connect`` (a driver's ``ray.init``), ``status`` (where a run
  stands), ``cli``, the package's lazy ``__init__``; beside it ``testing``, the rig.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ray_resilient

PACKAGE = Path(ray_resilient.__file__).parent
REPO = PACKAGE.parent
BASE = {"_ray_internals", "_lazy", "storage", "faults", "tracking"}
ALLOWED = {
    "_ray_internals": set(),
    "_lazy": set(),
    "faults": set(),
    "tracking": set(),
    "storage": {"_ray_internals"},
    "data": BASE,
    "goodput": BASE,
    "spare_workers": BASE,
    "checkpoint": BASE | {"goodput", "spare_workers"},
    "survivors": BASE | {"checkpoint", "goodput", "spare_workers"},
    "ray_config": BASE | {"checkpoint", "goodput", "spare_workers", "survivors"},
    "connect": set(),
    "status": BASE | {"checkpoint", "goodput"},
    "cli": BASE | {"checkpoint", "goodput", "status"},
    "__init__": BASE | {"checkpoint", "ray_config", "connect"},
    "testing": BASE | {"checkpoint", "data", "goodput", "spare_workers", "ray_config"},
}
RAY_INTERNALS = ("ray._private", "ray._raylet", "ray.core.generated", "ray.train.v2._internal")


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


def test_only_the_wall_touches_ray_internals():
    """Private Ray APIs are used in ``ray_resilient._ray_internals`` alone, nowhere in the package,
    jobs, benchmarks or scripts (tests/test_ray_internals.py checks each of them)."""
    wall = PACKAGE / "_ray_internals.py"
    sources = [*PACKAGE.rglob("*.py"), *(REPO / "jobs").glob("*.py"), *(REPO / "benchmarks").glob("*.py"),
               *(REPO / "examples").glob("*.py"), *(REPO / "cluster").glob("*.sh"), *(REPO / "scripts").glob("*.sh")]
    offenders = [f"{path.relative_to(REPO)}: {internal}" for path in sources if path != wall
                 for internal in RAY_INTERNALS if internal in path.read_text()]
    assert not offenders


@pytest.mark.parametrize("module", ["ray_resilient", "ray_resilient.data.download_process", "ray_resilient.cli"])
def test_light_modules_import_neither_torch_nor_ray(module):
    """The lazy package lets the download child and the command line start without torch or Ray."""
    code = f"import sys, {module}; print(sorted({{'torch', 'ray', 'mlflow'}} & set(sys.modules)))"
    heavy = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert heavy == "[]"


def test_the_package_exports_what_it_lists():
    import ray_resilient.checkpoint
    import ray_resilient.data
    import ray_resilient.goodput

    for package in (ray_resilient, ray_resilient.checkpoint, ray_resilient.data, ray_resilient.goodput):
        for name in package.__all__:
            assert getattr(package, name) is not None, f"{package.__name__}.{name}"
