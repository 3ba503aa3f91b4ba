"""``plan_mixed_ranks``: one accumulation count, a micro-batch per rank, the effective batch met
exactly, against brute force over every split on small cases; what it refuses (and what it
leaves to the request); and the mixed Plan's invariant."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Sequence

import pytest

from autobatch.errors import ConfigError, NoFeasiblePlanError
from autobatch.planning import Plan, PlanRequest, RankLimit, StepLine, plan_mixed_ranks
from tests.planning.test_planner import plan

# Two simulated cards: a fast one with twice the memory, a slower one.
FAST = StepLine(fixed_seconds=0.03, per_sample_seconds=0.004)
SLOW = StepLine(fixed_seconds=0.05, per_sample_seconds=0.0065)


def mixed(
    maxima: Sequence[int],
    *,
    effective_batch_size: int,
    step_lines: Sequence[StepLine] | None = None,
    multiple_of: int = 1,
    max_gradient_accumulation_steps: int | None = None,
) -> tuple[Plan, ...]:
    """:func:`plan_mixed_ranks` for ranks known by their maxima (and step lines)."""
    lines = [None] * len(maxima) if step_lines is None else step_lines
    ranks = [
        RankLimit(max_micro_batch_size=maximum, step_line=line)
        for maximum, line in zip(maxima, lines, strict=True)
    ]
    request = PlanRequest(
        effective_batch_size=effective_batch_size,
        world_size=len(ranks),
        multiple_of=multiple_of,
        max_gradient_accumulation_steps=max_gradient_accumulation_steps,
    )
    return plan_mixed_ranks(ranks, request)


def brute_force(
    maxima: Sequence[int],
    effective: int,
    lines: Sequence[StepLine] | None,
    multiple_of: int = 1,
    max_steps: int = 1 << 20,
) -> tuple[tuple[float, ...], int, tuple[int, ...]] | None:
    """The best (objective, k, split) over every k and every split: with lines the time per
    optimizer step, without the fewest k and then the largest share of a rank's max."""
    best = None
    for k in range(1, min(max_steps, effective) + 1):
        if effective % k:
            continue
        ranges = [range(multiple_of, m + 1, multiple_of) for m in maxima]
        for sizes in itertools.product(*ranges):
            if sum(sizes) * k != effective:
                continue
            objective: tuple[float, ...]
            if lines is None:
                objective = (k, max(s / m for s, m in zip(sizes, maxima, strict=True)))
            else:
                objective = (
                    k * max(line.seconds(s) for line, s in zip(lines, sizes, strict=True)),
                )
            if best is None or objective < best[0]:
                best = (objective, k, sizes)
    return best


def check_plans(
    plans: tuple[Plan, ...],
    maxima: Sequence[int],
    effective: int,
    multiple_of: int = 1,
    max_steps: int = 1 << 20,
) -> tuple[int, tuple[int, ...]]:
    """Every rank's plan states the same split, exact, within each rank's max; (k, sizes)."""
    assert len(plans) == len(maxima)
    sizes = plans[0].rank_micro_batch_sizes
    assert sizes is not None
    steps = plans[0].gradient_accumulation_steps
    assert sum(sizes) * steps == effective
    assert steps <= max_steps
    for rank, (one, maximum) in enumerate(zip(plans, maxima, strict=True)):
        assert one.rank_micro_batch_sizes == sizes
        assert one.gradient_accumulation_steps == steps
        assert one.micro_batch_size == sizes[rank]
        assert one.micro_batch_sizes == (sizes[rank],) * steps
        assert one.max_micro_batch_size == maximum
        assert one.world_size == len(maxima)
        assert one.effective_batch_size == one.requested_effective_batch_size == effective
        assert one.exact
        assert sizes[rank] % multiple_of == 0
        assert multiple_of <= sizes[rank] <= maximum
    return steps, sizes


# (maxima, effective_batch_size, step lines or None, multiple_of, max steps, k, sizes)
EXACT = [
    ([48, 20], 96, None, 1, None, 2, (34, 14)),
    ([32, 16], 48, None, 1, None, 1, (32, 16)),
    ([32, 16], 24, None, 1, None, 1, (16, 8)),
    ([80, 40, 40], 160, None, 1, None, 1, (80, 40, 40)),
    ([80, 40, 40], 170, None, 1, None, 2, (43, 21, 21)),
    ([48, 48, 20, 20], 256, None, 1, None, 2, (45, 45, 19, 19)),
    ([48, 48, 20, 20], 256, [FAST, FAST, SLOW, SLOW], 1, None, 2, (44, 44, 20, 20)),
    ([48, 20], 96, [FAST, SLOW], 1, None, 2, (32, 16)),  # k=3: 3 x 0.118 s > 2 x 0.158 s
    ([48, 20], 96, [FAST, SLOW], 8, None, 2, (32, 16)),
    ([48, 20], 96, None, 8, None, 2, (32, 16)),
    ([64, 64, 64, 16], 416, [FAST, FAST, FAST, SLOW], 16, 4, 2, (64, 64, 64, 16)),
    ([5, 11], 16, [FAST, FAST], 1, None, 1, (5, 11)),
    ([13], 39, None, 1, None, 3, (13,)),
    ([13], 39, [SLOW], 1, None, 3, (13,)),
]


@pytest.mark.parametrize(
    ("maxima", "effective", "lines", "multiple_of", "max_steps", "steps", "sizes"),
    EXACT,
)
def test_every_rank_plan_meets_the_effective_batch_exactly(
    maxima: list[int],
    effective: int,
    lines: list[StepLine] | None,
    multiple_of: int,
    max_steps: int | None,
    steps: int,
    sizes: tuple[int, ...],
) -> None:
    plans = mixed(
        maxima,
        effective_batch_size=effective,
        step_lines=lines,
        multiple_of=multiple_of,
        max_gradient_accumulation_steps=max_steps,
    )
    assert check_plans(plans, maxima, effective, multiple_of, max_steps or 1 << 20) == (
        steps,
        sizes,
    )


def test_more_steps_win_when_they_balance_the_ranks() -> None:
    # One step must put 11 on the second rank (0.054 s); two of (4, 4) take 2 x 0.026 s, four
    # of (2, 2) 4 x 0.018 s. Memory alone keeps the fewest steps.
    lines = [StepLine(fixed_seconds=0.01, per_sample_seconds=0.004)] * 2
    timed = mixed([5, 11], effective_batch_size=16, step_lines=lines)
    assert check_plans(timed, [5, 11], 16) == (2, (4, 4))
    assert timed[0].predicted_seconds_per_effective_batch == pytest.approx(2 * 0.026)
    fewest = mixed([5, 11], effective_batch_size=16)
    assert check_plans(fewest, [5, 11], 16) == (1, (5, 11))
    assert fewest[0].predicted_seconds_per_effective_batch is None


SMALL = [
    ([4, 2], 12, None, 1, 8),
    ([4, 2], 12, [FAST, SLOW], 1, 8),
    ([6, 6, 3], 30, [FAST, FAST, SLOW], 3, 8),
    ([9, 4, 4, 2], 38, None, 1, 8),
    ([9, 4, 4, 2], 38, [FAST, SLOW, SLOW, SLOW], 1, 8),
    ([12, 12, 6, 6], 60, [FAST, FAST, SLOW, SLOW], 2, 8),
    ([10, 3], 26, [StepLine(per_sample_seconds=0.0), SLOW], 1, 8),
    ([10, 3], 26, [StepLine(fixed_seconds=0.2, per_sample_seconds=0.0), SLOW], 1, 8),
    ([8, 8, 8], 48, [FAST, FAST, FAST], 1, 8),
]


Case = tuple[list[int], int, list[StepLine] | None, int, int]


def _random_cases(seed: int) -> list[Case]:
    """Up to 4 ranks of maxima up to 10, step lines or none: brute force enumerates each."""
    rng = random.Random(seed)
    cases: list[Case] = []
    while len(cases) < 120:
        world = rng.randint(1, 4)
        maxima = [rng.randint(1, 10) for _ in range(world)]
        lines = None
        if rng.random() < 0.6:
            lines = [
                StepLine(
                    fixed_seconds=rng.choice([0.0, rng.random()]),
                    per_sample_seconds=rng.choice([0.0, 0.25, rng.random()]),
                )
                for _ in range(world)
            ]
        multiple_of, max_steps = rng.choice([1, 1, 2, 3]), rng.choice([1, 3, 64])
        cases.append((maxima, rng.randint(world, 48), lines, multiple_of, max_steps))
    return cases


@pytest.mark.parametrize(
    ("maxima", "effective", "lines", "multiple_of", "max_steps"),
    SMALL + [case for seed in range(3) for case in _random_cases(seed)],
)
def test_the_plan_is_as_good_as_the_best_split_by_brute_force(
    maxima: list[int],
    effective: int,
    lines: list[StepLine] | None,
    multiple_of: int,
    max_steps: int,
) -> None:
    best = brute_force(maxima, effective, lines, multiple_of, max_steps)
    arguments = {
        "effective_batch_size": effective,
        "step_lines": lines,
        "multiple_of": multiple_of,
        "max_gradient_accumulation_steps": max_steps,
    }
    if best is None:
        refusal = "nearest reachable effective_batch_size|multiple_of .* exceeds rank"
        with pytest.raises(NoFeasiblePlanError, match=refusal):
            mixed(maxima, **arguments)  # type: ignore[arg-type]
        return
    plans = mixed(maxima, **arguments)  # type: ignore[arg-type]
    steps, sizes = check_plans(plans, maxima, effective, multiple_of, max_steps)
    if lines is None:
        shares = max(s / m for s, m in zip(sizes, maxima, strict=True))
        assert (steps, shares) == best[0]
    else:
        seconds = steps * max(line.seconds(s) for line, s in zip(lines, sizes, strict=True))
        assert seconds == pytest.approx(best[0][0], rel=1e-9, abs=1e-15)
        assert plans[0].predicted_seconds_per_effective_batch == pytest.approx(seconds)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("timed", [False, True])
def test_larger_cards_get_larger_micro_batches(seed: int, timed: bool) -> None:
    # A larger max, and with step lines a card no slower at every size, never gets less.
    rng = random.Random(seed)
    for _ in range(50):
        world = rng.randint(2, 12)
        maxima = [rng.choice([16, 20, 40, 48, 80]) for _ in range(world)]
        lines = [FAST if m >= 40 else SLOW for m in maxima] if timed else None
        effective = rng.randint(world, 3 * sum(maxima))
        try:
            plans = mixed(maxima, effective_batch_size=effective, step_lines=lines)
        except NoFeasiblePlanError:
            continue
        _, sizes = check_plans(plans, maxima, effective)
        for a, b in itertools.permutations(range(world), 2):
            if maxima[a] > maxima[b]:
                assert sizes[a] >= sizes[b], (maxima, effective, sizes)
            if maxima[a] == maxima[b]:
                assert abs(sizes[a] - sizes[b]) <= 1, (maxima, effective, sizes)


def test_a_thousand_ranks_and_a_million_samples_plan_exactly() -> None:
    rng = random.Random(7)
    maxima = [rng.randint(200, 2000) for _ in range(1024)]
    lines = [
        StepLine(fixed_seconds=rng.uniform(0, 0.05), per_sample_seconds=rng.uniform(1e-4, 1e-3))
        for _ in maxima
    ]
    for effective in (2**20, 720_720):
        check_plans(mixed(maxima, effective_batch_size=effective), maxima, effective)
        timed = mixed(maxima, effective_batch_size=effective, step_lines=lines)
        steps, sizes = check_plans(timed, maxima, effective)
        # no rank can take a sample from the slowest one and finish earlier than it does now
        slowest = max(line.seconds(s) for line, s in zip(lines, sizes, strict=True))
        assert timed[0].predicted_seconds_per_effective_batch == pytest.approx(steps * slowest)


# (maxima, effective_batch_size, multiple_of, max steps, below, above)
REFUSED = [
    ([48, 20], 97, 1, 1, "68", "none"),
    ([10, 10, 10], 31, 1, None, "30", "32"),
    ([10, 10, 10], 31, 2, None, "30", "32"),
    ([48, 20], 100, 8, None, "96", "112"),
    ([4, 4], 1, 1, None, "none", "2"),
    ([16, 8], 3, 8, None, "none", "16"),
    ([3, 2], 7, 1, 1, "5", "none"),
]


@pytest.mark.parametrize(
    ("maxima", "effective", "multiple_of", "max_steps", "below", "above"), REFUSED
)
def test_a_refusal_names_the_nearest_batches_that_can_be_met(
    maxima: list[int],
    effective: int,
    multiple_of: int,
    max_steps: int | None,
    below: str,
    above: str,
) -> None:
    if effective < len(maxima):
        with pytest.raises(ConfigError, match=f"effective_batch_size {effective} is less than"):
            mixed(maxima, effective_batch_size=effective)
        return
    with pytest.raises(
        NoFeasiblePlanError,
        match=f"reaches effective_batch_size {effective} on {len(maxima)} ranks.*"
        f"nearest reachable effective_batch_size: {below} below, {above} above",
    ) as caught:
        mixed(
            maxima,
            effective_batch_size=effective,
            multiple_of=multiple_of,
            max_gradient_accumulation_steps=max_steps,
        )
    nearest = tuple(int(v) for v in (below, above) if v != "none")
    assert caught.value.remedies[0].parameter == "effective_batch_size"
    assert caught.value.remedies[0].values == nearest
    for value in nearest:  # each one named can be met
        check_plans(
            mixed(
                maxima,
                effective_batch_size=value,
                multiple_of=multiple_of,
                max_gradient_accumulation_steps=max_steps,
            ),
            maxima,
            value,
            multiple_of,
        )


def test_multiple_of_above_a_rank_max_is_refused_by_rank() -> None:
    with pytest.raises(NoFeasiblePlanError, match="multiple_of 8 exceeds rank 1's max .* 6"):
        mixed([48, 6], effective_batch_size=96, multiple_of=8)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: RankLimit(max_micro_batch_size=0), "max_micro_batch_size 0 must be an int >= 1"),
        (lambda: RankLimit(max_micro_batch_size=True), "max_micro_batch_size True must be"),
        (lambda: RankLimit(max_micro_batch_size=2.5), "max_micro_batch_size 2.5 must be"),
        (
            lambda: plan_mixed_ranks([], PlanRequest(effective_batch_size=64)),
            "world_size 1 is not the number of ranks planned, 0",
        ),
        (
            lambda: plan_mixed_ranks(
                [RankLimit(max_micro_batch_size=48)] * 2, PlanRequest(effective_batch_size=64)
            ),
            "world_size 1 is not the number of ranks planned, 2",
        ),
        (lambda: mixed([48], effective_batch_size=0), "effective_batch_size 0 must be an int"),
        (lambda: mixed([48, 20], effective_batch_size=1), "effective_batch_size 1 is less than"),
        (lambda: mixed([48], effective_batch_size=64, multiple_of=0), "multiple_of 0 must be"),
        (
            lambda: mixed([48], effective_batch_size=64, max_gradient_accumulation_steps=2**21),
            "is more than the planner plans",
        ),
        (
            lambda: mixed(
                [48], effective_batch_size=64, step_lines=[StepLine(per_sample_seconds=-1)]
            ),
            "per_sample_seconds -1 must be finite seconds",
        ),
    ],
)
def test_bad_input_is_a_config_error_naming_the_value(
    build: Callable[[], object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build()


def test_the_ranks_entry_checks_nothing_the_request_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    request = PlanRequest(effective_batch_size=96, world_size=2, multiple_of=2)
    ranks = [RankLimit(max_micro_batch_size=48), RankLimit(max_micro_batch_size=20)]
    checked: list[str] = []

    def counted(name: str, value: object, minimum: int) -> None:
        checked.append(name)

    for module in ("_limits", "_request", "_mixed", "_mixed_limits"):
        monkeypatch.setattr(f"autobatch.planning.{module}.require_int", counted, raising=False)
    plans = plan_mixed_ranks(ranks, request)
    assert checked == []
    assert plans[0].rank_micro_batch_sizes == (34, 14)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"fixed_seconds": -1.0, "per_sample_seconds": 0.1}, "fixed_seconds -1.0 must be"),
        ({"per_sample_seconds": float("inf")}, "per_sample_seconds inf must be finite"),
        ({"per_sample_seconds": True}, "per_sample_seconds True must be"),
    ],
)
def test_a_step_line_refuses_negative_or_infinite_seconds(
    fields: dict[str, float], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        StepLine(**fields)


@pytest.mark.parametrize(
    ("timings", "fixed", "per_sample"),
    [
        ({8: 0.062, 16: 0.094, 32: 0.158}, 0.03, 0.004),  # on the line
        ({8: 0.1, 16: 0.1}, 0.1, 0.0),  # flat
        ({8: 0.2, 16: 0.1}, 0.15, 0.0),  # slower when smaller: the mean
        ({2: 0.01, 4: 0.05}, 0.0, 0.22 / 20),  # negative intercept: through the origin
    ],
)
def test_a_step_line_fits_timed_steps(
    timings: dict[int, float], fixed: float, per_sample: float
) -> None:
    line = StepLine.fit(timings)
    assert line.fixed_seconds == pytest.approx(fixed, abs=1e-12)
    assert line.per_sample_seconds == pytest.approx(per_sample, abs=1e-12)


@pytest.mark.parametrize(
    ("timings", "message"),
    [({8: 0.1}, "must map two micro-batch sizes or more"), ({0: 0.1, 8: 0.2}, "size 0 must")],
)
def test_a_step_line_needs_two_timed_sizes(timings: dict[int, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        StepLine.fit(timings)


def test_a_mixed_plan_round_trips_and_states_its_invariant() -> None:
    lines = [FAST, FAST, SLOW, SLOW]
    plans = mixed([48, 48, 20, 20], effective_batch_size=256, step_lines=lines)
    for one in plans:
        data = json.loads(json.dumps(one.to_dict()))
        assert data["rank_micro_batch_sizes"] == list(one.rank_micro_batch_sizes or ())
        assert Plan.from_dict(data) == one
    assert plans[2].formula() == (
        "effective_batch_size 256 = 128 (micro_batch_size summed over 4 ranks: 2 of 44, 2 of "
        "20) x 2 (gradient_accumulation_steps)"
    )
    assert plans[2].formula() in plans[2].notes
    assert any("world_size x micro_batch_size / effective_batch_size" in n for n in plans[0].notes)
    uniform = plan(24, effective_batch_size=64)
    assert uniform.rank_micro_batch_sizes is None
    assert uniform.to_dict()["rank_micro_batch_sizes"] is None
    assert Plan.from_dict(uniform.to_dict()) == uniform


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rank_micro_batch_sizes": (44, 44, 20)}, "needs world_size 4 sizes >= 1, got 3"),
        ({"rank_micro_batch_sizes": (44, 44, 20, 0)}, "needs world_size 4 sizes >= 1"),
        (
            {"rank_micro_batch_sizes": (44, 44, 20, 21)},
            "sum\\(rank_micro_batch_sizes\\) 129 \\* gradient_accumulation_steps 2 != "
            "effective_batch_size 256",
        ),
        ({"rank_micro_batch_sizes": (40, 48, 20, 20)}, "must be equal and one of"),
        ({"micro_batch_sizes": (45, 44)}, "must be equal"),
    ],
)
def test_a_plan_that_breaks_the_mixed_invariant_is_refused(
    change: dict[str, object], message: str
) -> None:
    data = mixed([48, 48, 20, 20], effective_batch_size=256)[0].to_dict()
    data.update({key: list(v) if isinstance(v, tuple) else v for key, v in change.items()})
    data["requested_effective_batch_size"] = data["effective_batch_size"]
    with pytest.raises(ConfigError, match=message):
        Plan.from_dict(data)


def test_an_epoch_is_planned_for_uniform_ranks_only() -> None:
    first = mixed([48, 20], effective_batch_size=96)[0]
    with pytest.raises(ConfigError, match="with_epoch plans uniform ranks only"):
        first.with_epoch(1000)
