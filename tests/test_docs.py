"""The README and docs/ say what the code does: their snippets run as printed (every name they use,
they define), the values their comments print are the values the code gives, their links resolve,
every ``autobatch`` name they show is public, and the README starts with the set-up commands."""

from __future__ import annotations

import ast
import importlib
import re
import shlex
import types
from pathlib import Path
from typing import Any

import pytest

import autobatch
from autobatch.cli import main as cli_main
from autobatch.device import REASONS
from tests.test_exports import FACES

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]

MAIN_JOB = (
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && "
    ".venv/bin/pip install -e '.[models]' && .venv/bin/autobatch tune gpt2 --seq-len 128 "
    "--device sim:3GiB --effective-batch-size 96"
)
TEST_COMMAND = (
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && "
    ".venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest -m \"not gpu\""
)
CI_REPORTING_FLAGS = "-q -p no:cacheprovider"
"""What .ci/run adds to the README's pytest command: output only, the same tests."""

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```[ \t]*$", flags=re.DOTALL | re.MULTILINE)


def _blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in _FENCE.findall(page.read_text()) if lang == language]


def _snippet(page: Path, marker: str) -> str:
    """The one ```python block of ``page`` that contains ``marker``."""
    found = [block for block in _blocks(page, "python") if marker in block]
    assert len(found) == 1, f"{page.name}: {len(found)} python blocks contain {marker!r}"
    return found[0]


def _printed_value(line: str) -> Any:
    """The literal a snippet's comment shows, ``x  # (16, 4)``, or ``# [1, 2]: words``."""
    comment = line.split("  # ", 1)[1]
    for text in (comment, comment.split(": ", 1)[0]):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            continue
    raise AssertionError(f"the comment of {line.strip()!r} shows no Python value")


def _run(page: Path, source: str) -> dict[str, Any]:
    """Run ``source`` statement by statement; a bare expression with a comment must evaluate to
    the value the comment shows (so the docs cannot print a stale number)."""
    namespace: dict[str, Any] = {"__name__": "docs"}
    lines = source.splitlines()
    for node in ast.parse(source).body:
        last_line = lines[node.end_lineno - 1]  # type: ignore[operator]
        if isinstance(node, ast.Expr) and "  # " in last_line:
            expression = ast.Expression(node.value)
            value = eval(compile(expression, str(page), "eval"), namespace)  # noqa: S307
            assert value == _printed_value(last_line), (page.name, last_line.strip(), value)
        else:
            module = ast.Module(body=[node], type_ignores=[])
            exec(compile(module, str(page), "exec"), namespace)  # noqa: S102
    return namespace


def test_accumulator_snippet_runs_and_steps_once_per_window() -> None:
    page = DOCS / "training-loop.md"
    namespace = _run(page, _snippet(page, "scheduler=scheduler"))

    plan, stats, scheduler = namespace["plan"], namespace["stats"], namespace["scheduler"]
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (16, 4)
    assert stats.global_count == 64 and stats.num_micro_steps == 4  # the last window is whole
    assert scheduler.last_epoch == 640 // 64  # one scheduler step per window


def test_last_short_window_snippet_steps_with_its_real_size() -> None:
    page = DOCS / "training-loop.md"
    namespace = _run(page, _snippet(page, "counts = []"))

    # 100 samples in micro-batches of 16: a whole window of 4, then 16 + 16 + 4 = 36.
    assert namespace["counts"] == [(4, 64), (3, 36)]
    assert namespace["optimizer"].state == {}  # SGD without momentum keeps no state


def test_epoch_snippet_prints_the_epochs_numbers() -> None:
    page = DOCS / "training-loop.md"
    namespace = _run(page, _snippet(page, "with_epoch(125)"))  # checks the printed (1, 125)

    assert namespace["plan"].epoch.num_full_steps == 0


def test_deadline_snippet_builds_a_deadline() -> None:
    page = DOCS / "training-loop.md"
    namespace = _run(page, _snippet(page, "AgreementDeadline(min_seconds=600"))

    assert namespace["deadline"].seconds(1.0) == 600


def test_readme_autotune_snippet_probes_then_answers_from_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    users = tmp_path / "users.sqlite3"
    monkeypatch.setenv("AUTOBATCH_STORE", str(users))
    monkeypatch.chdir(tmp_path)  # the snippet's own store is a file where it runs
    source = _snippet(README, "autobatch.autotune(")

    first = _run(README, source)["plan"]
    assert (first.micro_batch_size, first.gradient_accumulation_steps) == (2048, 2)
    assert first.effective_batch_size == 4096 and first.exact
    assert first.source == "measured"
    assert first.capacity_bytes == 8 * 2**20

    again = _run(README, source)["plan"]  # the same step on the same card: from the store
    assert again.source == "cached"
    assert (again.micro_batch_size, again.gradient_accumulation_steps) == (2048, 2)
    # Its own store, apart from the user's.
    assert (tmp_path / "readme-profiles.sqlite3").is_file() and not users.exists()


def test_planner_snippet_gives_the_rules_table_examples() -> None:
    page = DOCS / "how-it-works.md"
    namespace = _run(page, _snippet(page, "allow_inexact=True"))

    assert (namespace["plan"].micro_batch_size, namespace["plan"].gradient_accumulation_steps) == (
        16,
        4,
    )
    assert namespace["prime"].micro_batch_sizes == (20, 20, 19, 19, 19)
    assert sum(namespace["prime"].micro_batch_sizes) == 97
    assert "use effective_batch_size=99 or 102" in namespace["refused"]
    nearest = namespace["nearest"]
    assert (nearest.effective_batch_size, nearest.exact) == (99, False)
    assert nearest.micro_batch_size * nearest.gradient_accumulation_steps * 3 == 99
    # The table states the same examples.
    text = page.read_text()
    assert '| E=100, W=3: "use 99 or 102" |' in text
    assert "E=64, max 24: 16 × 4" in text and "E=97, max 24: [20, 20, 19, 19, 19]" in text


def test_devices_snippet_shows_a_declared_fraction_deciding() -> None:
    page = DOCS / "devices.md"
    namespace = _run(page, _snippet(page, "gpu_fraction=0.5).capacity()"))
    assert namespace["card"].budget.trials_per_gpu is None  # a device's budget, not a plan's


def test_framework_configs_snippet_prints_the_configs() -> None:
    page = DOCS / "training-loop.md"
    namespace = _run(page, _snippet(page, "deepspeed_config(plan)"))

    config = namespace["deepspeed_config"](namespace["plan"])
    assert config == {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 4}


def test_cli_plan_table_is_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    text = (DOCS / "quickstart.md").read_text()
    command_then_output = r"```bash\nautobatch (plan [^\n]*)\n```\n\n```text\n(.*?)```"
    found = re.search(command_then_output, text, re.DOTALL)
    assert found is not None
    assert cli_main(found[1].split()) == 0
    printed = capsys.readouterr().out
    assert [line.rstrip() for line in printed.splitlines()] == [
        line.rstrip() for line in found[2].splitlines()
    ]


def test_readme_is_short_and_starts_with_the_two_setup_commands() -> None:
    assert len(README.read_text().splitlines()) <= 200
    first, second = _blocks(README, "bash")[:2]
    assert first.strip() == MAIN_JOB
    assert second.strip() == TEST_COMMAND
    # What the main job prints follows its command, before the three ways in.
    text = README.read_text()
    assert text.index(MAIN_JOB) < text.index("source                       measured")
    assert text.index("source                       measured") < text.index("## Three ways in")


def test_ci_runs_the_readme_test_command() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    pytest_part = TEST_COMMAND.split(" && ")[-1]
    assert lines[-1] == f"{pytest_part} {CI_REPORTING_FLAGS}"
    assert shlex.split(lines[-1])[: len(shlex.split(pytest_part))] == shlex.split(pytest_part)


def _prose(page: Path) -> str:
    """The page without its fenced blocks (headings and links live outside them)."""
    return _FENCE.sub("", page.read_text())


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(page), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", _prose(page))
    assert links or page != README
    for link in links:
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.is_file(), f"{page.name}: {link} names no file"
        assert ROOT in target.parents, f"{page.name}: {link} leaves the repository"
        if anchor:
            assert anchor in _anchors(target), f"{page.name}: {link}: no such heading"


def _lines_after_tables(text: str) -> list[tuple[int, str]]:
    """Each line that directly follows a table row and is neither a row nor blank, with its
    number: Markdown reads such a line as one more row of the table."""
    found: list[tuple[int, str]] = []
    in_fence = in_table = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            in_fence, in_table = not in_fence, False
            continue
        if in_fence:
            continue
        row = line.lstrip().startswith("|")
        if in_table and not row and line.strip():
            found.append((number, line))
        in_table = row
    return found


def test_lines_after_tables_finds_a_paragraph_glued_to_a_table() -> None:
    text = "| a | b |\n|---|---|\n| 1 | 2 |\nglued\n\n| c |\n|---|\n\napart\n```\n| x |\ny\n```\n"
    assert _lines_after_tables(text) == [(4, "glued")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_paragraph_follows_a_table_row_without_a_blank_line(page: Path) -> None:
    assert _lines_after_tables(page.read_text()) == [], (
        f"{page.name}: add a blank line after the table"
    )


def test_the_readme_links_every_docs_page() -> None:
    linked = {Path(link) for link in re.findall(r"\]\((docs/[^)#]+)", README.read_text())}
    assert linked == {page.relative_to(ROOT) for page in DOCS.glob("*.md")}
    assert (ROOT / "LICENSE").is_file()


def _resolve(dotted: str) -> object:
    """What ``autobatch.x.y`` names, reached only through a public face (no private module)."""
    parts = dotted.split(".")
    cut = max(i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in FACES)
    value: object = importlib.import_module(".".join(parts[:cut]))
    for part in parts[cut:]:
        assert hasattr(value, part), f"{dotted}: {part!r} is not in {value!r}"
        value = getattr(value, part)
        if isinstance(value, types.ModuleType):
            assert value.__name__ in FACES, f"{dotted}: {value.__name__} is a private module"
    return value


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_import_only_public_names(page: Path) -> None:
    for block in _blocks(page, "python"):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autobatch"):
                assert node.module in FACES, f"{page.name}: from {node.module} import ..."
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{page.name}: {node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "autobatch":
                        assert alias.name in FACES, f"{page.name}: import {alias.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_autobatch_name_shown_is_public(page: Path) -> None:
    # In code and in prose: `autobatch.plan`, `autobatch.integrations.lightning.AutobatchFinder`.
    names = set(re.findall(r"(?<![\w/.])autobatch(?:\.\w+)+", page.read_text()))
    for name in sorted(names):
        _resolve(name)


def test_resolve_refuses_what_is_gone_or_private() -> None:
    with pytest.raises(AssertionError, match="'deepspeed_config' is not in"):
        _resolve("autobatch.deepspeed_config")
    importlib.import_module("autobatch.device._visible")  # an attribute of the package from here on
    with pytest.raises(AssertionError, match="autobatch.device._visible is a private module"):
        _resolve("autobatch.device._visible.resolve_visible")
    assert _resolve("autobatch.integrations.deepspeed_config") is not None
    assert _resolve("autobatch.Accumulator") is autobatch.Accumulator


def test_service_page_lists_every_nvml_reason_code() -> None:
    text = (DOCS / "service.md").read_text()
    table = re.search(r"\| reason \| cause \| what to do \|\n\|[-|]+\|\n((?:\|.*\n)+)", text)
    assert table is not None
    codes = re.findall(r"^\| `(\w+)` \|", table[1], flags=re.MULTILINE)
    assert codes and sorted(codes) == sorted(REASONS)


def test_service_page_lists_every_serve_flag_and_metric() -> None:
    settings = pytest.importorskip("service.web.settings")
    metrics = pytest.importorskip("service.web.metrics")
    text = (DOCS / "service.md").read_text()
    flags = set(re.findall(r"^\| `(--[\w-]+)` \|", text, flags=re.MULTILINE))
    assert flags == {"--" + name.replace("_", "-") for name in settings.Settings.model_fields}

    rendered = metrics.Metrics().render(list).decode()
    shown = set(re.findall(r"\bautobatch_\w+", text))
    assert len(shown) == 8
    for name in shown:
        assert f"# TYPE {name} " in rendered, name
