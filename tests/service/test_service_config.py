"""The model registry file: valid entries load, invalid ones name the entry, field and reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from autobatch.errors import ConfigError
from service.probes.registry import load_registry
from tests.service.models import REGISTRY_TOML


def test_registry_loads(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(REGISTRY_TOML)
    registry = load_registry(path)
    entry = registry.models["tiny-mlp"]
    assert (entry.factory, entry.device, entry.loss) == (
        "tests.service.models:tiny_mlp",
        "sim:8MiB",
        "cross_entropy",
    )
    assert entry.inputs["target"].dtype == "int64" and entry.inputs["input"].shape == [32]
    assert load_registry(None).models == {}


@pytest.mark.parametrize(
    ("fields", "limit"),
    [
        ("", 4096),  # no effective batch: the registered max
        ("effective_batch_size = 1000\n", 1000),
        ("effective_batch_size = 1000\nworld_size = 8\n", 125),
        ("effective_batch_size = 1001\nworld_size = 8\n", 126),  # ceil: 126 x 8 >= 1001
        ("effective_batch_size = 100000\n", 4096),
    ],
)
def test_a_probe_job_never_tries_a_size_no_plan_can_use(
    tmp_path: Path, fields: str, limit: int
) -> None:
    path = tmp_path / "models.toml"
    path.write_text(
        '[models.x]\nfactory = "tests.service.models:tiny_mlp"\nmax_micro_batch_size = 4096\n'
        f"{fields}[models.x.inputs.a]\nshape = [1]\n"
    )
    assert load_registry(path).models["x"].search_limit == limit


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[models.x\n", "not valid TOML"),
        ('[models.x]\nfactory = "os.system"\n[models.x.inputs.a]\nshape = [1]\n', "factory"),
        (
            '[models.x]\nfactory = "m:f"\ndevice = "tpu"\n[models.x.inputs.a]\nshape = [1]\n',
            "models.x.device",
        ),
        (
            '[models.x]\nfactory = "m:f"\nloss = "cross_entropy"\n'
            "[models.x.inputs.a]\nshape = [1]\n",
            "exactly 'input' and 'target'",
        ),
        (
            '[models.x]\nfactory = "m:f"\nshell = "rm -rf /"\n[models.x.inputs.a]\nshape = [1]\n',
            "models.x.shell",
        ),
    ],
)
def test_registry_errors_name_the_field(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_registry(path)


def test_missing_registry_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the model registry"):
        load_registry(tmp_path / "nope.toml")


def test_the_example_registry_loads() -> None:
    from pathlib import Path

    from service.probes.registry import load_registry

    registry = load_registry(Path(__file__).resolve().parents[2] / "examples" / "models.toml")
    assert sorted(registry.models) == ["gpt2-512", "tiny-mlp"]
    assert registry.models["tiny-mlp"].device == "sim:64MiB"


@pytest.mark.parametrize(
    ("factory", "module"),
    [("no_such_module:build", "no_such_module"), ("tests.no_such:build", "tests.no_such")],
)
def test_a_factory_module_that_cannot_be_found_fails_at_load(
    tmp_path: Path, factory: str, module: str
) -> None:
    # At start, not at the first probe ten seconds into a job (and without importing it).
    path = tmp_path / "models.toml"
    path.write_text(f'[models.x]\nfactory = "{factory}"\n[models.x.inputs.a]\nshape = [1]\n')
    with pytest.raises(ConfigError, match=f"model 'x': cannot find module '{module}'"):
        load_registry(path)


def test_serve_names_the_flag_and_variable_of_a_bad_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.__main__ import main

    monkeypatch.setenv("AUTOBATCH_PORT", "abc")
    assert main([]) == 2
    assert capsys.readouterr().err.strip() == (
        "autobatch serve: error: --port / AUTOBATCH_PORT: Input should be a valid integer, "
        "unable to parse string as an integer (got 'abc')"
    )
    monkeypatch.delenv("AUTOBATCH_PORT")
    monkeypatch.setenv("AUTOBATCH_API_TOKEN", "   ")
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "autobatch serve: error: --api-token / AUTOBATCH_API_TOKEN: the API token is"
    )
    assert "got" not in err  # a token, even a blank one, is never echoed


def test_serve_on_a_port_in_use_says_so_in_one_line_before_starting(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import socket

    from service.__main__ import main

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code = main(["--host", "127.0.0.1", "--port", str(port), "--store-path", ":memory:"])
    out, err = capsys.readouterr()
    assert (code, out) == (1, "")
    assert err == (
        f"autobatch serve: error: port {port} on 127.0.0.1 is in use: choose another with "
        "--port (or stop the process that holds it)\n"
    )
