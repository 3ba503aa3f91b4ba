"""The library's layers: data flows down, nothing imports upward or sideways across the table
below, and another sub-package's private module is reached only through its face.

Every import counts, wherever it is: the modules' whole syntax trees are walked, not only their
top-level statements. An import is an ``import`` or ``from ... import`` statement (a relative
one resolved against the module's own package, and ``from package import module`` naming the
module), a call of ``importlib.import_module``, ``__import__`` or :func:`autobatch.extras.require`
with a literal module name, and a module path among the string values of a lazy-export table
(a name ending in ``EXPORTS``, as in ``autobatch/__init__.py``). The checking functions take the
repository root, so the tests at the end plant each kind of violation in a fake tree and see it
reported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autobatch"
FOLDERS = ("autobatch", "service", "bench", "examples")
"""The folders whose modules the private-reach check reads."""

LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(names.split())
    for names in (
        "errors extras launchers margin timings units",
        "device",
        "conditions profile",
        "distributed",
        "planning",
        "store",
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
    "store": {"torch", "pynvml", "httpx"},
    "client": {"torch", "pynvml", "sqlalchemy"},
    "conditions": {"torch", "pynvml"},
    "profile": {"torch", "pynvml"},
}
"""Libraries a layer never imports itself (pure planning; a store that knows nothing of HTTP or
devices; a client light enough for a scheduler)."""

IMPORT_CALLS = frozenset({"import_module", "__import__", "require"})
"""Functions whose first argument, a literal string, is a module imported by the call
(``importlib.import_module``, the builtin ``__import__``, ``autobatch.extras.require``)."""


def module_name(relative: str) -> tuple[str, bool]:
    """The dotted name of the module at ``relative`` (a path from the repository root), and
    whether it is a package's ``__init__``: ``autobatch/client/_http.py`` ->
    ``("autobatch.client._http", False)``."""
    parts = list(Path(relative).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _resolve(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module ``node`` imports from, in the module ``name``."""
    if node.level == 0:
        return node.module or ""
    package = name.split(".") if is_package else name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _is_module(root: Path | None, module: str) -> bool:
    """Whether ``module`` is a module or package of the tree at ``root``."""
    if root is None:
        return False
    path = root.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _literal_import(node: ast.Call) -> str | None:
    """The module a call of an :data:`IMPORT_CALLS` function names by a literal, else None."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name not in IMPORT_CALLS or not node.args:
        return None
    first = node.args[0]
    if isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value
    return None


def _export_table_modules(node: ast.Assign | ast.AnnAssign) -> Iterable[str]:
    """The module paths among the string values of a lazy-export table (``_EXPORTS = {...}``)."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    if node.value is None or not any(
        isinstance(t, ast.Name) and t.id.endswith("EXPORTS") for t in targets
    ):
        return
    for inner in ast.walk(node.value):
        if isinstance(inner, ast.Dict):
            for value in inner.values:
                for constant in ast.walk(value):
                    if (
                        isinstance(constant, ast.Constant)
                        and isinstance(constant.value, str)
                        and constant.value.split(".")[0] in ("autobatch", "service")
                    ):
                        yield constant.value


def imported_modules(source: str, relative: str = "", root: Path | None = None) -> set[str]:
    """Every absolute module name that ``source`` imports, anywhere in its syntax tree.

    Args:
        source: the module's text.
        relative: its path from the repository root (resolves relative imports); empty for a
            snippet with absolute imports only.
        root: the repository root, to tell ``from package import module`` (the module counts)
            from ``from package import name``; None counts only the package.
    """
    name, is_package = module_name(relative) if relative else ("", False)
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = _resolve(node, name, is_package)
            if module:
                found.add(module)
            found.update(
                f"{module}.{alias.name}"
                for alias in node.names
                if _is_module(root, f"{module}.{alias.name}")
            )
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Call) and (literal := _literal_import(node)):
            found.add(literal)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            found.update(_export_table_modules(node))
    return found


def layer_of(module: str) -> str | None:
    """``autobatch.store._cache`` -> ``profiles``; ``service.main`` -> ``service``; None for
    another package."""
    parts = module.split(".")
    if parts[0] == "service":
        return "service"
    if parts[0] == "autobatch" and len(parts) > 1:
        return parts[1]
    return None


def library_modules(root: Path) -> list[Path]:
    """The library's modules that belong to a layer (all but ``autobatch/__init__.py`` and
    ``__main__.py``)."""
    package = root / "autobatch"
    return sorted(p for p in package.rglob("*.py") if p.parent != package or p.stem in RANK)


def _imports_of(root: Path, path: Path) -> set[str]:
    return imported_modules(path.read_text(), str(path.relative_to(root)), root)


def upward_imports(root: Path) -> dict[str, list[str]]:
    """The library modules under ``root`` that import a layer above their own, by path, with
    what they import; and those that import a library their layer never imports."""
    found: dict[str, list[str]] = {}
    for path in library_modules(root):
        relative = path.relative_to(root / "autobatch")
        layer = relative.parts[0] if len(relative.parts) > 1 else relative.stem
        forbidden = THIRD_PARTY_FORBIDDEN.get(layer, set())
        wrong = sorted(
            module
            for module in _imports_of(root, path)
            if ((target := layer_of(module)) is not None and RANK[target] > RANK[layer])
            or module.split(".")[0] in forbidden
        )
        if wrong:
            found[str(path.relative_to(root))] = wrong
    return found


def private_reach(relative: str, source: str, root: Path | None = None) -> list[str]:
    """The other sub-packages' private modules that the module at ``relative`` (a path from the
    repository root) imports in ``source``; its own package's are its to use (its face may load
    them lazily), and every other module goes through a sub-package's face."""
    parts = Path(relative).parts
    own = parts[1] if parts[0] == "autobatch" and len(parts) > 2 else None
    return sorted(
        module
        for module in imported_modules(source, relative, root)
        if module.split(".")[0] == "autobatch"
        and len(module.split(".")) > 2
        and module.split(".")[1] != own
        and any(part.startswith("_") for part in module.split(".")[2:])
    )


def private_reaches(root: Path, folders: Iterable[str] = FOLDERS) -> dict[str, list[str]]:
    """Every module under ``root``'s ``folders`` that reaches another sub-package's private
    module, by path, with the modules it reaches."""
    return {
        relative: reach
        for folder in folders
        for path in sorted((root / folder).rglob("*.py"))
        if (reach := private_reach(relative := str(path.relative_to(root)), path.read_text(), root))
    }


MODULES = library_modules(ROOT)


def test_the_table_names_every_layer_of_the_library() -> None:
    layers = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    layers |= {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "__main__"}
    assert layers | {"service"} == set(RANK)


def test_no_module_imports_a_layer_above_its_own() -> None:
    assert upward_imports(ROOT) == {}


def test_the_store_layer_knows_nothing_of_http_or_the_service() -> None:
    # The remote (the central service among them) is passed in from above: profiles/ neither
    # imports the client nor the service, in a function body or anywhere else.
    offenders = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted((PACKAGE / "store").rglob("*.py"))
        for module in _imports_of(ROOT, path)
        if layer_of(module) in ("client", "service", "cli", "tuning") or module == "httpx"
    }
    assert not offenders, sorted(offenders)


def test_the_store_layer_is_storage_only_and_imports_no_torch() -> None:
    # The cross-rank cache policy needs torch's collectives: it lives on the tuning road, so
    # the store (what the service and the CLI's plan import) loads without torch.
    reaching = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in sorted((PACKAGE / "store").rglob("*.py"))
        for module in imported_modules(path.read_text())
        if layer_of(module) in ("distributed", "probing", "training")
    }
    assert not reaching, sorted(reaching)
    code = "import sys, autobatch.store; print('torch' in sys.modules)"
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
        if any(m.split(".")[0] == "pynvml" for m in _imports_of(ROOT, path))
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


@pytest.mark.parametrize("folder", FOLDERS)
def test_no_module_imports_another_subpackages_private_module(folder: str) -> None:
    assert private_reaches(ROOT, [folder]) == {}


# The guards on planted violations: a fake tree, each kind of import the checks claim to see.


def test_the_walk_finds_an_import_inside_a_function_body() -> None:
    source = (
        "import os\n"
        "def report(profile):\n"
        "    if profile:\n"
        "        from autobatch.client._publish import report_profile\n"
        "    import autobatch.service_side as s\n"
    )
    assert imported_modules(source) == {"os", "autobatch.client._publish", "autobatch.service_side"}


@pytest.mark.parametrize(
    ("relative", "statement", "module"),
    [
        ("autobatch/device/_cuda.py", "from ._nvml import read", "autobatch.device._nvml"),
        ("autobatch/device/__init__.py", "from ._nvml import read", "autobatch.device._nvml"),
        ("autobatch/tuning/_tune.py", "from ..client import x", "autobatch.client"),
        ("autobatch/tuning/_tune.py", "from ..client._http import x", "autobatch.client._http"),
        ("autobatch/live.py", "from .probing import x", "autobatch.probing"),
        ("autobatch/live.py", "from . import units", "autobatch"),
        ("service/routes/plans.py", "from ..jobs import x", "service.jobs"),
    ],
)
def test_a_relative_import_resolves_against_the_modules_package(
    relative: str, statement: str, module: str
) -> None:
    assert module in imported_modules(statement + "\n", relative)


def _plant(root: Path, files: dict[str, str]) -> Path:
    """Write ``files`` (paths from ``root`` to their text) under ``root``, with the packages'
    ``__init__.py`` files; return ``root``."""
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for folder in {p.parent for p in root.rglob("*.py")}:
        if folder.relative_to(root).parts[0] in ("autobatch", "service"):
            (folder / "__init__.py").touch()
    return root


FAKE_TREE = {
    "autobatch/client/_http.py": "def get():\n    return 1\n",
    "autobatch/device/_nvml.py": "def read():\n    return 1\n",
    "autobatch/device/_cuda.py": "from ._nvml import read\n",
    "autobatch/tuning/_tune.py": "from ..client._http import get\n",
    "autobatch/probing/_prober.py": (
        "import importlib\n"
        "def device():\n"
        "    return importlib.import_module('autobatch.device._nvml')\n"
    ),
    "autobatch/training/_window.py": "def f():\n    return __import__('autobatch.device._nvml')\n",
    "autobatch/planning/_limits.py": "from autobatch.device import _nvml\n",
    "autobatch/__init__.py": (
        "_EXPORTS = {\n"
        "    'get': 'autobatch.client._http',\n"
        "    **dict.fromkeys(('read',), 'autobatch.device._nvml'),\n"
        "}\n"
    ),
    "service/jobs.py": "from autobatch.client import _http\n",
    "bench/plan_call.py": "from autobatch.device._nvml import read\n",
    "examples/train.py": "def main():\n    from autobatch.client._http import get\n",
}


def test_the_private_reach_guard_reports_each_planted_violation(tmp_path: Path) -> None:
    root = _plant(tmp_path, FAKE_TREE)
    assert private_reaches(root) == {
        "autobatch/__init__.py": ["autobatch.client._http", "autobatch.device._nvml"],
        "autobatch/planning/_limits.py": ["autobatch.device._nvml"],
        "autobatch/probing/_prober.py": ["autobatch.device._nvml"],
        "autobatch/training/_window.py": ["autobatch.device._nvml"],
        "autobatch/tuning/_tune.py": ["autobatch.client._http"],
        "bench/plan_call.py": ["autobatch.device._nvml"],
        "examples/train.py": ["autobatch.client._http"],
        "service/jobs.py": ["autobatch.client._http"],
    }


def test_the_layer_guard_reports_each_planted_upward_import(tmp_path: Path) -> None:
    root = _plant(
        tmp_path,
        {
            "autobatch/planning/_limits.py": "from ..tuning import tune\n",
            "autobatch/device/_cuda.py": "def f():\n    return __import__('autobatch.probing')\n",
            "autobatch/store/_store.py": "import importlib\nimportlib.import_module('service')",
            "autobatch/errors.py": "_EXPORTS = {'tune': 'autobatch.tuning'}\n",
            "autobatch/client/_http.py": "from . import _wire\nimport sqlalchemy\n",
            "autobatch/client/_wire.py": "",
            "autobatch/tuning/_tune.py": "from ..client import _http\nfrom ..device import _cuda\n",
        },
    )
    assert upward_imports(root) == {
        "autobatch/client/_http.py": ["sqlalchemy"],
        "autobatch/device/_cuda.py": ["autobatch.probing"],
        "autobatch/errors.py": ["autobatch.tuning"],
        "autobatch/planning/_limits.py": ["autobatch.tuning"],
        "autobatch/store/_store.py": ["service"],
    }


def test_the_private_reach_check_tells_its_own_package_from_another() -> None:
    body = "def f():\n    from autobatch.device._nvml import read\n"
    assert private_reach("autobatch/device/_cuda.py", body) == []
    assert private_reach("autobatch/probing/_prober.py", body) == ["autobatch.device._nvml"]
    assert private_reach("service/devices/gpus.py", body) == ["autobatch.device._nvml"]
    assert private_reach("autobatch/tuning/_tune.py", "from autobatch.device import x\n") == []


SERVICE = ROOT / "service"
SERVICE_LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(names.split())
    for names in (
        "service.web",
        "service.devices",
        "service.fleet service.probes",
        "service.deps",
        "service.plans service.profiles service.probes.routes service.devices.routes "
        "service.health",
        "service.admissions",
        "service service.main service.__main__",
    )
)
"""The service's own layers, bottom first, by module or package: the HTTP plumbing every
feature shares; the long-lived objects of the features (the GPU monitor, then the fleet's
clients and the probe runs, which may read the GPUs); the app's state that holds them; each
feature's work and routes; the admission decision (a scheduler's question, answered from the
plans feature's choice and planner); the app. A module imports its own row and the rows below,
and a feature (``plans``, ``profiles``, ``probes``, ``devices``, ``fleet``, ``admissions``)
imports another feature only from a row below its own."""

SERVICE_RANK = {name: rank for rank, names in enumerate(SERVICE_LAYERS) for name in names}
FEATURES = frozenset({"plans", "profiles", "probes", "devices", "fleet", "admissions"})


def service_row(module: str) -> str:
    """The table's entry for ``module``: its longest prefix there (``service.plans.answers`` ->
    ``service.plans``, ``service.probes.routes`` itself); ``service`` for the package's face."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:end])) in SERVICE_RANK:
            return prefix
    raise AssertionError(f"{module} is in no row of SERVICE_LAYERS")


def service_module(path: Path) -> str:
    """``service/plans/routes.py`` -> ``service.plans.routes``; a package's face is its name."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def service_violations(module: str, source: str) -> list[str]:
    """The imports in ``source`` (the module ``module`` of the service) that reach a row above
    its own, or another feature's module in the same row."""
    own = service_row(module)
    feature = module.split(".")[1] if module.count(".") else None
    found = []
    for target in sorted(imported_modules(source)):
        if target.split(".")[0] != "service":
            continue
        row = service_row(target)
        other = target.split(".")[1] if target.count(".") else None
        if SERVICE_RANK[row] > SERVICE_RANK[own]:
            found.append(f"{target} (above)")
        elif (
            SERVICE_RANK[row] == SERVICE_RANK[own]
            and feature in FEATURES
            and other in FEATURES
            and other != feature
        ):
            found.append(f"{target} (another feature)")
    return found


SERVICE_MODULES = sorted(SERVICE.rglob("*.py"))


def test_the_service_table_places_every_module() -> None:
    for path in SERVICE_MODULES:
        service_row(service_module(path))
    packages = {p.parent.name for p in SERVICE.glob("*/__init__.py")}
    assert packages == FEATURES | {"web"}


@pytest.mark.parametrize("path", SERVICE_MODULES, ids=lambda p: str(p.relative_to(SERVICE)))
def test_no_service_module_imports_a_row_above_or_another_features_beside_it(path: Path) -> None:
    module = service_module(path)
    assert service_violations(module, path.read_text()) == [], module


def test_the_service_check_fails_on_planted_imports() -> None:
    assert service_violations("service.web.store_calls", "from service.deps import X\n") == [
        "service.deps (above)"
    ]
    assert service_violations(
        "service.plans.answers", "def f():\n    from service.profiles.routes import x\n"
    ) == ["service.profiles.routes (another feature)"]
    assert service_violations("service.plans.limits", "import service.fleet.central\n") == []
    assert service_violations("service.main", "from service.plans import routes\n") == []
