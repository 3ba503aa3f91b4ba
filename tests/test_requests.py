"""The request objects (PlanRequest, TuneRequest): each range checked once, in one place."""

from __future__ import annotations

import ast
import inspect
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import autobatch
from autobatch import PlanRequest, TuneRequest
from autobatch.cli import main
from autobatch.conditions import check_world_size
from autobatch.errors import ConfigError, python_wording
from autobatch.margin import DEFAULT_SAFETY_MARGIN, check_safety_margin
from autobatch.planning import given_budget, plan_request, plan_table
from autobatch.probing import check_search_arguments
from autobatch.profile import MemoryModel
from autobatch.tuning import (
    BuildOptions,
    ProfileOptions,
    TuneOptions,
    autotune_profile,
    tune_request,
)
from tests.planning.test_planner import make_profile

GIB = 2**30
TINY = ["tests.service.models:tiny_mlp", "--input-shape", "32"]
MARGIN_REFUSED = "safety_margin 1.5 must be a number in [0, 1), e.g. 0.05"
"""check_safety_margin's words for 1.5: every surface says the same."""


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"effective_batch_size": 0}, "effective_batch_size 0 must be an int >= 1"),
        ({"effective_batch_size": True}, "effective_batch_size True must be an int >= 1"),
        ({"world_size": 0}, "world_size 0 must be an int >= 1"),
        ({"world_size": 128}, "use effective_batch_size >= 128 or world_size <= 64"),
        ({"multiple_of": 0}, "multiple_of 0 must be an int >= 1"),
        ({"max_gradient_accumulation_steps": 0}, "max_gradient_accumulation_steps 0 must be"),
        ({"max_gradient_accumulation_steps": 2**21}, "2097152 is more than the planner plans"),
        ({"uneven": "sometimes"}, "uneven 'sometimes' must be one of ['auto', 'never', 'always']"),
        ({"allow_inexact": 1}, "allow_inexact 1 must be a bool"),
        ({"uneven": "always", "multiple_of": 8}, "use uneven='auto', or multiple_of=1"),
        ({"safety_margin": 1.5}, MARGIN_REFUSED),
        ({"safety_margin": -0.1}, "safety_margin -0.1 must be a number in [0, 1)"),
        ({"capacity_bytes": 0}, "capacity_bytes 0 must be an int >= 1"),
        ({"step_seconds": {8: 0.1}}, "step_seconds needs step times at two sizes or more"),
        ({"step_seconds": {8: 0.1, 16: -1.0}}, "step_seconds[16] -1.0 must be finite seconds > 0"),
        ({"world_sizes": 4}, "world_sizes 4 must be a list of ints, e.g. [1, 2, 4, 8]"),
        ({"world_sizes": (1, 0)}, "world_size 0 must be an int >= 1"),
    ],
)
def test_a_plan_request_refuses_each_bad_value_naming_it_and_the_fix(
    changes: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        PlanRequest(**{"effective_batch_size": 64, **changes})
    assert words in refused.value.describe(python_wording)


def test_a_plan_request_keeps_world_sizes_as_a_tuple_and_plans_like_plan() -> None:
    request = PlanRequest(effective_batch_size=96, world_sizes=[1, 2, 5])
    assert request.world_sizes == (1, 2, 5)
    assert plan_request(24, request) == autobatch.plan(24, effective_batch_size=96)
    rows = plan_table(24, request)
    assert [(r.world_size, r.plan and r.plan.micro_batch_sizes) for r in rows] == [
        (1, (24, 24, 24, 24)),
        (2, (24, 24)),
        (5, None),
    ]
    assert rows == autobatch.plan_world_sizes(24, effective_batch_size=96, world_sizes=[1, 2, 5])


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"safety_margin": 1.5}, MARGIN_REFUSED),
        ({"safety_margin": "0.1"}, "safety_margin '0.1' must be a number in [0, 1)"),
        ({"max_micro_batch_size": 0}, "max_micro_batch_size 0 must be an int >= 1"),
        ({"effective_batch_size": 0}, "effective_batch_size 0 must be an int >= 1"),
        ({"effective_batch_size": 64, "uneven": "odd"}, "uneven 'odd' must be one of"),
        ({"effective_batch_size": 64, "multiple_of": 0}, "multiple_of 0 must be an int >= 1"),
    ],
)
def test_a_tune_request_refuses_each_bad_value_naming_it_and_the_fix(
    changes: dict[str, Any], words: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        TuneRequest.build(torch.nn.Linear(2, 2), torch.zeros(1, 2), **changes)
    assert words in refused.value.describe(python_wording)


def test_a_tune_request_holds_its_plan_part_checked_and_none_without_a_batch() -> None:
    model, sample = torch.nn.Linear(2, 2), torch.zeros(1, 2)
    request = TuneRequest.build(model, sample, effective_batch_size=96, multiple_of=8)
    assert request.plan == PlanRequest(effective_batch_size=96, multiple_of=8)
    assert request.probe.safety_margin == DEFAULT_SAFETY_MARGIN == 0.05
    assert request.step.model is model
    assert TuneRequest.build(model, sample).plan is None
    with pytest.raises(ConfigError, match="needs effective_batch_size; for the profile alone"):
        tune_request(TuneRequest.build(model, sample))


def test_a_tune_request_is_built_for_the_launchers_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # The data-parallel size is resolved when the request is built: the plan part holds the
    # truth, and the probe's conditions say where it came from.
    for name, value in {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    request = TuneRequest.build(torch.nn.Linear(2, 2), torch.zeros(1, 2), effective_batch_size=96)
    assert request.plan is not None and request.plan.world_size == 4
    assert request.probe.conditions.world_size == 4
    assert "WORLD_SIZE=4" in request.probe.conditions.world_size_source
    given = TuneRequest.build(
        torch.nn.Linear(2, 2), torch.zeros(1, 2), effective_batch_size=96, world_size=2
    )
    assert given.plan is not None and given.plan.world_size == 2


def test_the_option_declarations_are_what_the_builder_takes() -> None:
    # One declaration per entry: TuneOptions (autotune, tune) and ProfileOptions
    # (autotune_profile) name exactly the keywords TuneRequest.build accepts, besides the
    # model, the sample and effective_batch_size.
    built = inspect.signature(TuneRequest.build).parameters
    keywords = {n for n, p in built.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords == {"effective_batch_size"}
    assert built["options"].kind is inspect.Parameter.VAR_KEYWORD
    tune_keys, profile_keys = set(TuneOptions.__annotations__), set(ProfileOptions.__annotations__)
    assert set(BuildOptions.__annotations__) == tune_keys | profile_keys
    with pytest.raises(TypeError, match="unexpected keyword argument 'batch_size'"):
        TuneRequest.build(torch.nn.Linear(2, 2), torch.zeros(1, 2), batch_size=4)  # type: ignore[call-arg]
    assert tune_keys - profile_keys == {
        "world_size",
        "data_parallel_size",
        "process_group",
        "multiple_of",
        "max_gradient_accumulation_steps",
        "uneven",
        "allow_inexact",
        "mixed_ranks",
        "activation_checkpointing",
        "checkpoint_block_class",
    }
    assert profile_keys - tune_keys == {"use_estimate"}
    assert len(tune_keys) + 3 == 30  # model, sample, effective_batch_size and the options


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (
            lambda m, s: autobatch.autotune(m, s, effective_batch_size=8, use_estimate=False),
            "autotune() got an unexpected keyword argument 'use_estimate'",
        ),
        (
            lambda m, s: autobatch.tune(m, s, effective_batch_size=8, batch_size=4),
            "tune() got an unexpected keyword argument 'batch_size'",
        ),
        (
            lambda m, s: autotune_profile(m, s, effective_batch_size=8),
            "autotune_profile() got an unexpected keyword argument 'effective_batch_size'",
        ),
        (
            # autotune without it answers the largest micro-batch; tune still needs it
            lambda m, s: autobatch.tune(m, s, world_size=2),  # type: ignore[call-arg]
            "missing 1 required keyword-only argument: 'effective_batch_size'",
        ),
    ],
)
def test_the_keyword_functions_refuse_an_undeclared_keyword_as_python_does(
    call: Callable[[torch.nn.Module, torch.Tensor], object], words: str
) -> None:
    with pytest.raises(TypeError, match=re.escape(words)):
        call(torch.nn.Linear(2, 2), torch.zeros(1, 2))


def _cli_words(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    # The parser only parses: the range is the library's check, shown as the CLI's error.
    assert main(list(argv)) == 1
    return capsys.readouterr().err


def test_every_surface_refuses_safety_margin_1_5_with_the_one_check(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[object] = []

    def counted(value: object) -> float:
        seen.append(value)
        return check_safety_margin(value)

    # Every surface goes through autobatch.margin.check_safety_margin: counted where it is
    # looked up at call time (the modules that import it by name are patched too).
    for module in (
        "autobatch.probing._options",
        "autobatch.planning._request",
        "autobatch.profile",
        "autobatch.cli._parser",
    ):
        monkeypatch.setattr(f"{module}.check_safety_margin", counted)
    model, sample, profile = torch.nn.Linear(2, 2), torch.zeros(1, 2), make_profile()
    calls: list[Callable[[], object]] = [
        lambda: autobatch.autotune(model, sample, effective_batch_size=8, safety_margin=1.5),
        lambda: autotune_profile(model, sample, safety_margin=1.5),
        lambda: autobatch.plan(profile, effective_batch_size=64, safety_margin=1.5),
        lambda: autobatch.plan_world_sizes(
            profile, effective_batch_size=64, world_sizes=[1, 2], safety_margin=1.5
        ),
        lambda: make_profile(safety_margin=1.5),
    ]
    for index, call in enumerate(calls):
        seen.clear()
        with pytest.raises(ConfigError, match=re.escape(MARGIN_REFUSED)):
            call()
        assert seen and set(seen) == {1.5}
        if index < 2:  # the tuning road: checked once, where the request is built
            assert seen == [1.5]
    for command in ("tune", "estimate"):
        seen.clear()
        argv = [command, *TINY, "--safety-margin", "1.5"]
        extra = ["--effective-batch-size", "8", "--no-store", "--device", "sim:1GiB"]
        extra = extra if command == "tune" else ["--capacity", "1GiB"]
        refused = MARGIN_REFUSED.removeprefix("safety_margin ")
        with pytest.raises(SystemExit) as exited:  # as the flags are read: no model loads
            main([*argv, *extra])
        assert exited.value.code == 2
        assert f"argument --safety-margin: {refused}" in capsys.readouterr().err
        assert seen == [1.5]  # the library's one check, called by the parser


def test_each_road_checks_the_margin_and_the_search_cap_once(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[object, object]] = []

    def counted(max_micro_batch_size: int, safety_margin: float) -> None:
        seen.append((max_micro_batch_size, safety_margin))
        check_search_arguments(max_micro_batch_size, safety_margin)

    for module in ("autobatch.probing._options", "autobatch.probing._estimator"):
        monkeypatch.setattr(f"{module}.check_search_arguments", counted)
    model, sample = torch.nn.Linear(4, 2), torch.zeros(1, 4)
    options: dict[str, Any] = {
        "device": "sim:64MiB",
        "use_store": False,
        "loss_fn": lambda out: out.float().pow(2).mean(),
    }
    roads: list[Callable[[], object]] = [
        lambda: autobatch.autotune(model, sample, effective_batch_size=8, **options),
        lambda: autotune_profile(model, sample, max_micro_batch_size=64, **options),
        lambda: main(
            [
                "tune",
                *TINY,
                "--effective-batch-size",
                "8",
                "--json",
                "--no-store",
                "--device",
                "sim:256MiB",
                "--max-micro-batch-size",
                "64",
            ]
        ),
    ]
    for road in roads:
        seen.clear()
        road()
        assert len(seen) == 1, seen
    capsys.readouterr()
    seen.clear()
    refused = ["--effective-batch-size", "8", "--no-store", "--max-micro-batch-size", "0"]
    words = _cli_words(capsys, "tune", *TINY, "--device", "sim:64MiB", *refused)
    assert "argument --max-micro-batch-size: 0 must be an int >= 1" in words
    assert seen == [(0, DEFAULT_SAFETY_MARGIN)]


def test_the_service_refuses_safety_margin_1_5_with_the_library_words() -> None:
    from pydantic import ValidationError

    from service.plans.schemas import PlanCreate
    from service.probes.registry import ModelEntry
    from service.web.schemas import ProfileCreate

    body = {"profile_id": "ab12", "effective_batch_size": 8, "safety_margin": 1.5}
    profile = {**json.loads(json.dumps(make_profile().to_dict())), "safety_margin": 1.5}
    entry = {"factory": "m:f", "inputs": {"x": {"shape": [2]}}, "safety_margin": 1.5}
    for model, data in ((PlanCreate, body), (ProfileCreate, profile), (ModelEntry, entry)):
        with pytest.raises(ValidationError) as refused:
            model.model_validate(data)
        (error,) = refused.value.errors()
        assert error["loc"] == ("safety_margin",)
        assert MARGIN_REFUSED in error["msg"]
    schema = PlanCreate.model_json_schema()["properties"]["safety_margin"]["anyOf"][0]
    assert (schema["minimum"], schema["exclusiveMaximum"]) == (0.0, 1.0)


# -- the plan -> budget -> table sequence --------------------------------------------------------


def test_the_entries_plan_then_budget_then_table() -> None:
    budget = given_budget(16 * GIB, gpu_fraction=0.5)
    line = MemoryModel(fixed_bytes=GIB, bytes_per_sample=100 * 2**20)
    request = PlanRequest(
        effective_batch_size=256,
        world_size=2,
        world_sizes=(1, 2, 3),
        capacity_bytes=budget.budget_bytes,
    )
    planned = plan_request(line, request, budget=budget)
    # A memory line keeps the default margin: 8 GiB * 0.95 holds 1 GiB + 67 * 100 MiB.
    assert planned.max_micro_batch_size == 67
    assert (planned.micro_batch_size, planned.gradient_accumulation_steps) == (64, 2)
    assert planned.budget is not None
    peak = planned.predicted_peak_memory_bytes
    assert peak == GIB + 64 * 100 * 2**20
    # trials_per_gpu divides the whole card (16 GiB less the 5% margin) by the peak.
    assert planned.budget.trials_per_gpu == int(16 * GIB * 0.95) // peak == 2
    rows = plan_table(line, request, budget=budget)
    assert [row.world_size for row in rows] == [1, 2, 3]
    assert rows[1].plan == planned
    assert rows[2].plan is None and "not a multiple of world_size 3" in rows[2].reason
    assert rows[0].plan is not None and rows[0].plan.budget is not None
    # Without a budget, the same plans with none on them.
    bare = plan_request(line, request)
    assert bare.budget is None and bare.micro_batch_size == planned.micro_batch_size
    assert [row.plan and row.plan.budget for row in plan_table(line, request)] == [None] * 3


def test_without_world_sizes_or_budget_the_entries_are_the_plain_plan() -> None:
    request = PlanRequest(effective_batch_size=64)
    assert plan_table(24, request) == []
    planned = plan_request(24, request)
    assert planned == autobatch.plan(24, effective_batch_size=64)
    assert planned.budget is None


def test_a_profile_budget_takes_the_profile_margin_unless_the_request_gives_one() -> None:
    budget = given_budget(8 * GIB)
    profile = make_profile(safety_margin=0.2, recommended_micro_batch_size=54)
    own = plan_request(profile, PlanRequest(effective_batch_size=64), budget=budget)
    given = plan_request(
        profile, PlanRequest(effective_batch_size=64, safety_margin=0.05), budget=budget
    )
    for result, margin in ((own, 0.2), (given, 0.05)):
        assert result.budget is not None and result.predicted_peak_memory_bytes is not None
        expected = int(8 * GIB * (1 - margin)) // result.predicted_peak_memory_bytes
        assert result.budget.trials_per_gpu == expected


def test_each_planning_surface_checks_each_range_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from autobatch.client import PlanQuery
    from autobatch.client._http import _query
    from autobatch.planning import RankLimit, plan_mixed_ranks
    from autobatch.planning._limits import require_int

    seen: list[str] = []

    def counted(name: str, value: object, minimum: int) -> None:
        seen.append(name)
        require_int(name, value, minimum)

    def counted_world_size(value: object) -> int:
        seen.append("world_size")
        return check_world_size(value)

    for module in ("_limits", "_request", "_mixed", "_mixed_limits", "_selection"):
        monkeypatch.setattr(f"autobatch.planning.{module}.require_int", counted, raising=False)
    monkeypatch.setattr("autobatch.planning._request.check_world_size", counted_world_size)
    once = ["multiple_of", "effective_batch_size", "world_size"]
    limit = "max micro-batch size (limit)"  # where a plan is made, not where it is asked for
    calls: list[tuple[Callable[[], object], list[str]]] = [
        (lambda: autobatch.plan(24, effective_batch_size=64, world_size=2), [*once, limit]),
        (
            lambda: plan_request(24, PlanRequest(effective_batch_size=64, world_size=2)),
            [*once, limit],
        ),
        (lambda: _query(64, None, {"world_size": 2, "max_micro_batch_size": 24}), once),
        (
            lambda: PlanQuery(
                plan=PlanRequest(effective_batch_size=64, world_size=2), max_micro_batch_size=24
            ),
            once,
        ),
    ]
    for call, expected in calls:
        seen.clear()
        call()
        assert sorted(seen) == sorted(expected), seen
    ranks = [RankLimit(max_micro_batch_size=48), RankLimit(max_micro_batch_size=20)]
    seen.clear()
    plan_mixed_ranks(ranks, PlanRequest(effective_batch_size=96, world_size=2))
    assert sorted(seen) == sorted(once)  # the request's checks alone


def test_every_surface_builds_the_tune_request_through_the_one_builder() -> None:
    # The library's keyword functions, the CLI's tune, the drop-ins and the service's probe
    # jobs all call TuneRequest.build; nothing constructs the request field by field.
    root = Path(__file__).resolve().parents[1]
    builders: set[str] = set()
    by_hand: list[str] = []
    for path in sorted([*(root / "autobatch").rglob("*.py"), *(root / "service").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            called = node.func
            where = str(path.relative_to(root))
            if isinstance(called, ast.Name) and called.id == "TuneRequest":
                by_hand.append(where)
            elif (
                isinstance(called, ast.Attribute)
                and called.attr == "build"
                and isinstance(called.value, ast.Name)
                and called.value.id == "TuneRequest"
            ):
                builders.add(where)
    assert by_hand == []
    assert builders == {
        "autobatch/cli/_commands.py",
        "autobatch/integrations/_dropins.py",
        "autobatch/tuning/_tune.py",
        "service/probes/runs.py",
    }
