"""A missing optional dependency is one line naming the extra that installs it, on every surface
that needs one: the store's PostgreSQL driver, the built-in models, the service, the drop-ins.

Each case runs in a child process whose import system refuses the module, as on a machine
without it (``ModuleNotFoundError`` with its name, what a missing distribution raises).
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from autobatch.errors import ConfigError, MissingExtraError
from autobatch.extras import EXTRAS, install_hint, needs_extra, require

ROOT = Path(__file__).resolve().parents[2]

BLOCK = """
import importlib.abc, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

for name in [n for n in sys.modules if n.partition(".")[0] == {module!r}]:
    del sys.modules[name]
sys.meta_path.insert(0, Blocker())
"""


def run_without(module: str, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCK.format(module=module) + code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def cli_without(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return run_without(module, f"from autobatch.cli import main\nsys.exit(main({list(argv)!r}))\n")


@pytest.mark.parametrize(
    ("module", "argv", "line"),
    [
        (
            "psycopg",
            ["--store", "postgresql://ci:s3cret@127.0.0.1:1/profiles", "profiles", "list"],
            "the PostgreSQL profile store postgresql://ci:***@127.0.0.1:1/profiles needs the "
            "'postgres' extra (psycopg is not installed): pip install -e '.[postgres]' in the "
            "autobatch checkout",
        ),
        (
            "transformers",
            ["estimate", "gpt2-tiny", "--capacity", "1GiB"],
            "a built-in model needs the 'models' extra (transformers is not installed): "
            "pip install -e '.[models]' in the autobatch checkout",
        ),
        (
            "fastapi",
            ["serve", "--port", "0"],
            "autobatch serve needs the 'service' extra (fastapi is not installed): "
            "pip install -e '.[service]' in the autobatch checkout",
        ),
        (
            "prometheus_client",
            ["serve"],
            "autobatch serve needs the 'service' extra (prometheus_client is not installed): "
            "pip install -e '.[service]' in the autobatch checkout",
        ),
    ],
    ids=["postgres", "models", "service", "service-metrics"],
)
def test_the_cli_prints_one_line_naming_the_extra(module: str, argv: list[str], line: str) -> None:
    done = cli_without(module, *argv)
    command = argv[2:] if argv[0] == "--store" else argv  # the global flag goes first
    prog = " ".join(command[:2] if command[0] == "profiles" else command[:1])
    error = f"autobatch {prog}: error: {line}\n"
    assert (done.returncode, done.stdout, done.stderr) == (1, "", error)


def test_the_python_store_raises_the_same_error_an_import_error_too() -> None:
    done = run_without(
        "psycopg",
        "from autobatch.store import ProfileStore\n"
        "from autobatch.errors import MissingExtraError\n"
        "try:\n"
        "    ProfileStore('postgresql://ci@127.0.0.1:1/profiles')\n"
        "except ImportError as exc:\n"
        "    assert isinstance(exc, MissingExtraError)\n"
        "    print(exc.extra, exc.module, exc.name)\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "postgres psycopg psycopg\n"


def test_the_lightning_drop_in_names_its_extra_on_import() -> None:
    done = run_without(
        "lightning",
        "try:\n"
        "    import autobatch.integrations.lightning\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        "MissingExtraError autobatch.integrations.lightning needs the 'lightning' extra "
        "(lightning is not installed): pip install -e '.[lightning]' in the autobatch checkout\n"
    )


def test_require_returns_the_module_and_keeps_other_import_errors() -> None:
    assert require("json", extra="models", purpose="x").__name__ == "json"
    with pytest.raises(MissingExtraError, match="^x needs the 'models' extra"):
        require("no_such_module_of_autobatch", extra="models", purpose="x")
    # Inside the block, a module of no extra missing is a broken install: it propagates as is.
    with pytest.raises(ModuleNotFoundError) as raised, needs_extra("models", purpose="x"):
        import no_such_module_of_autobatch  # noqa: F401
    assert not isinstance(raised.value, MissingExtraError)
    with pytest.raises(ValueError, match="unknown extra 'postgress'"):
        require("json", extra="postgress", purpose="x")


def test_every_extra_named_is_one_pyproject_declares() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(EXTRAS) <= set(declared)
    assert issubclass(MissingExtraError, ConfigError) and issubclass(MissingExtraError, ImportError)
    assert install_hint("hf") == "pip install -e '.[hf]' in the autobatch checkout"
