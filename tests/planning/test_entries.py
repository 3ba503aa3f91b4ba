"""The planning face: one entry per question, each taking the request; the keyword options of
``autobatch.plan`` and ``autobatch.plan_world_sizes`` declared once, as the request's fields."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import autobatch
import autobatch.planning as planning
from autobatch.live import plan, plan_world_sizes
from autobatch.planning import PlanOptions, PlanRequest, SplitOptions

# Every public function of the face. Three plan: one plan, a table over world sizes, ranks of
# mixed cards; the others answer other questions (a budget, a profile's selection, lines, a
# report's data).
FUNCTIONS = {
    "plan_request",
    "plan_table",
    "plan_mixed_ranks",
    "given_budget",
    "select_profile",
    "check_arrival",
    "uncatalogued_note",
    "condition_mismatches",
    "stored_profile_source",
    "largest_useful_micro_batch_size",
    "fit_memory_model",
    "fit_wide_line",
    "checkpointing_modes_to_try",
    "choose_checkpointing",
    "timing_noise",
    "mode_report",
    "profile_report",
}


def test_the_face_has_one_plan_entry_per_question() -> None:
    functions = {name for name in planning.__all__ if inspect.isfunction(getattr(planning, name))}
    assert functions == FUNCTIONS
    planners = {name for name in functions if name.startswith("plan")}
    assert planners == {"plan_request", "plan_table", "plan_mixed_ranks"}
    assert planning.__all__ == sorted(planning.__all__, key=lambda n: (not n.isupper(), n))


@pytest.mark.parametrize("entry", ["plan_request", "plan_table", "plan_mixed_ranks"])
def test_each_entry_takes_the_request_and_the_budget(entry: str) -> None:
    parameters = inspect.signature(getattr(planning, entry)).parameters
    assert list(parameters)[:2] in (["limit", "request"], ["ranks", "request"])
    assert parameters["budget"].kind is inspect.Parameter.KEYWORD_ONLY
    assert parameters["budget"].default is None


def test_the_keyword_options_are_the_request_fields() -> None:
    fields = {field.name for field in dataclasses.fields(PlanRequest)}
    split = set(SplitOptions.__optional_keys__)
    assert split | {"effective_batch_size", "world_size", "world_sizes"} == fields
    assert set(PlanOptions.__optional_keys__) == split | {"world_size"}
    # Their defaults are the request's: an unset option plans as the request's default does.
    defaults = PlanRequest(effective_batch_size=1)
    assert {name: getattr(defaults, name) for name in split} == {
        "multiple_of": 1,
        "max_gradient_accumulation_steps": None,
        "uneven": "auto",
        "allow_inexact": False,
        "safety_margin": None,
        "capacity_bytes": None,
        "step_seconds": None,
    }


def test_the_keyword_functions_take_the_declared_options_and_nothing_else() -> None:
    for function, named in (
        (plan, ["limit", "effective_batch_size", "source", "options"]),
        (plan_world_sizes, ["limit", "effective_batch_size", "world_sizes", "source", "options"]),
    ):
        assert list(inspect.signature(function).parameters) == named
    assert autobatch.plan is plan and autobatch.plan_world_sizes is plan_world_sizes
    with pytest.raises(TypeError, match="unexpected keyword argument 'batch_size'"):
        plan(24, effective_batch_size=64, batch_size=8)  # type: ignore[call-arg]


def test_the_keyword_functions_plan_as_the_entries() -> None:
    request = PlanRequest(effective_batch_size=96, world_size=2, multiple_of=8)
    assert plan(24, effective_batch_size=96, world_size=2, multiple_of=8) == (
        planning.plan_request(24, request)
    )
    table = PlanRequest(effective_batch_size=96, world_sizes=(1, 5), uneven="never")
    rows = plan_world_sizes(24, effective_batch_size=96, world_sizes=[1, 5], uneven="never")
    assert rows == planning.plan_table(24, table)
    assert [row.plan is None for row in rows] == [False, True]
