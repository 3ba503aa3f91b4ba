"""A degraded plan's note words its way back in each surface's terms: a flag, a JSON field."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from autobatch.cli import main
from tests.planning.test_degraded_notes import PRIME, degraded


def test_the_cli_and_the_service_word_the_way_back_as_a_flag_and_a_field(
    capsys: pytest.CaptureFixture[str], client: TestClient
) -> None:
    argv = ["plan", "--max-micro-batch-size", "24", "--effective-batch-size", "97"]
    argv += ["--uneven", "never"]
    assert main(argv) == 0
    assert f"note: {PRIME.format(uneven='--uneven auto')}\n" in capsys.readouterr().out
    body = {"max_micro_batch_size": 24, "effective_batch_size": 97, "uneven": "never"}
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 200, response.text
    notes = response.json()["plan"]["notes"]
    assert degraded(notes) == [PRIME.format(uneven='"uneven": "auto"')]
