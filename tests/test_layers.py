"""The library's layers (issue 34): data flows down, nothing imports upward or sideways across
the table below. Every import counts, a lazy one in a function body included: the modules' whole
syntax trees are walked, not only their top-level statements."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autobatch"

LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(names.split())
    for names in (
        "errors extras launchers margin timings units",
        "device",
        "conditions profile",
        "distributed",
        "planning",
        "profiles",
        "probing",
        "training live",
        "client",
        "tuning",
        "integrations models",
        "cli service",
    )
)
"""Bottom first: a layer imports its own and the layers below it (``service`` is the top-level
package beside ``autobatch``; ``autobatch/__init__.py`` is the face of them all)."""

RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}

THIRD_PARTY_FORBIDDEN = {
    "planning": {"torch", "pynvml", "httpx", "sqlalchemy"},
    "profiles": {"torch", "pynvml", "httpx"},
    "client": {"torch", "pynvml", "sqlalchemy"},
    "conditions": {"torch", "pynvml"},
    "profile": {"torch", "pynvml"},
}
"""Libraries a layer never imports itself (pure planning; a store that knows nothing of HTTP or
devices; a client light enough for a scheduler)."""


def imported_modules(source: str) -> set[str]:
    """Every absolute module name that ``source`` imports, anywhere in its syntax tree."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def layer_of(module: str) -> str | None:
    """``autobatch.profiles._cache`` -> ``profiles``; ``service.main`` -> ``service``; None for
    another package."""
    parts = module.split(".")
    if parts[0] == "service":
        return "service"
    if parts[0] == "autobatch" and len(parts) > 1:
        return parts[1]
    return None


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE or p.stem in RANK)


def test_the_table_names_every_layer_of_the_library() -> None:
    layers = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    layers |= {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    assert layers | {"service"} == set(RANK)


def test_the_walk_finds_an_import_inside_a_function_body() -> None:
    source = (
        "import os\n"
        "def report(profile):\n"
        "    if profile:\n"
        "        from autobatch.client._publish import report_profile\n"
        "    import autobatch.service_side as s\n"
    )
    assert imported_modules(source) == {"os", "autobatch.client._publish", "autobatch.service_side"}


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_layer_above_its_own(path: Path) -> None:
    relative = path.relative_to(PACKAGE)
    layer = relative.parts[0] if len(relative.parts) > 1 else relative.stem
    upward = {
        module
        for module in imported_modules(path.read_text())
        if (target := layer_of(module)) is not None and RANK[target] > RANK[layer]
    }
    assert not upward, f"{relative} ({layer}) imports {sorted(upward)} from above it"
    forbidden = THIRD_PARTY_FORBIDDEN.get(layer, set())
    foreign = {
        module for module in imported_modules(path.read_text()) if module.split(".")[0] in forbidden
    }
    assert not foreign, f"{relative} ({layer}) imports {sorted(foreign)}"


def test_the_store_layer_knows_nothing_of_http_or_the_service() -> None:
    # The remote (the central service among them) is passed in from above: profiles/ neither
    # imports the client nor the service, in a function body or anywhere else.
    offenders = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted((PACKAGE / "profiles").rglob("*.py"))
        for module in imported_modules(path.read_text())
        if layer_of(module) in ("client", "service", "cli", "tuning") or module == "httpx"
    }
    assert not offenders, sorted(offenders)


def test_the_store_layer_is_storage_only_and_imports_no_torch() -> None:
    # The cross-rank cache policy needs torch's collectives: it lives on the tuning road, so
    # the store (what the service and the CLI's plan import) loads without torch.
    reaching = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted((PACKAGE / "profiles").rglob("*.py"))
        for module in imported_modules(path.read_text())
        if layer_of(module) in ("distributed", "probing", "training")
    }
    assert not reaching, sorted(reaching)
    code = "import sys, autobatch.profiles; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.stdout.strip() == "False"


def test_only_the_nvml_module_imports_pynvml() -> None:
    importers = {
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if any(m.split(".")[0] == "pynvml" for m in imported_modules(path.read_text()))
    }
    assert importers == {"device/_nvml.py"}


SUBPACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
PUBLIC_MODULES = {
    "autobatch/integrations/accelerate.py",
    "autobatch/integrations/hf.py",
    "autobatch/integrations/lightning.py",
}
"""Documented modules a user imports by name (the drop-ins); every other module inside a
sub-package is private, its face (``__init__.py``) the way in."""


def test_every_module_inside_a_subpackage_is_marked_private() -> None:
    unmarked = [
        str(path.relative_to(ROOT))
        for package in SUBPACKAGES
        for path in sorted((PACKAGE / package).glob("*.py"))
        if not path.stem.startswith("_") and str(path.relative_to(ROOT)) not in PUBLIC_MODULES
    ]
    assert not unmarked, f"name these _module.py (private) or list them as public: {unmarked}"


def private_reach(relative: str, source: str) -> list[str]:
    """The other sub-packages' private modules that the module at ``relative`` (a path from the
    repository root) imports in ``source``; its own package's are its to use."""
    parts = Path(relative).parts
    own = parts[1] if parts[0] == "autobatch" and len(parts) > 2 else None
    return sorted(
        module
        for module in imported_modules(source)
        if module.split(".")[0] == "autobatch"
        and len(module.split(".")) > 2
        and module.split(".")[1] != own
        and any(part.startswith("_") for part in module.split(".")[2:])
    )


@pytest.mark.parametrize(
    "folder", ["autobatch", "service", "bench", "examples"], ids=lambda folder: folder
)
def test_no_module_imports_another_subpackages_private_module(folder: str) -> None:
    offenders = {
        relative: reach
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (reach := private_reach(relative := str(path.relative_to(ROOT)), path.read_text()))
    }
    assert not offenders, offenders


def test_the_private_reach_check_tells_its_own_package_from_another() -> None:
    body = "def f():\n    from autobatch.device._nvml import read\n"
    assert private_reach("autobatch/device/_cuda.py", body) == []
    assert private_reach("autobatch/probing/_prober.py", body) == ["autobatch.device._nvml"]
    assert private_reach("service/gpus.py", body) == ["autobatch.device._nvml"]
    assert private_reach("autobatch/tuning/_road.py", "from autobatch.device import x\n") == []
