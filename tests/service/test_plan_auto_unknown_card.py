"""POST /v1/plan ``activation_checkpointing: "auto"``: a mode whose profile cannot be planned for
the card asked (422 ``unknown-card``: measured on another card, the card's memory unknown) is
skipped and named in the answer's notes, instead of failing the whole choice with that mode's
422; when no mode answers, that 422 still comes back."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.plans import limits
from service.web.problems import Problem
from tests.service.test_plan_card import publish
from tests.service.test_plan_checkpointing import _on
from tests.service.test_service_api import problem

H100, B888 = "NVIDIA H100 80GB HBM3", "NVIDIA B888"


def _ask(client: TestClient, card: str) -> Any:
    return client.post(
        "/v1/plan",
        json={
            "model_fingerprint": "fp-gpt2",
            "effective_batch_size": 64,
            "card": card,
            "activation_checkpointing": "auto",
        },
    )


def test_auto_skips_a_mode_that_cannot_be_planned_for_the_card(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = publish(client, _on(H100, "node-a", "none", 20))
    publish(client, _on(H100, "node-a", "full", 96))
    select = limits.select

    def full_unplannable(body: Any, *args: Any) -> Any:
        if body.activation_checkpointing == "full":  # as a profile on a card of unknown memory
            raise Problem(422, "unknown-card", "its memory is unknown", field="body.card")
        return select(body, *args)

    monkeypatch.setattr(limits, "select", full_unplannable)
    response = _ask(client, H100)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["profile_id"] == plain  # full would win (64 x 1), but it was skipped
    assert answer["plan"]["activation_checkpointing"] == "none"
    assert "activation checkpointing full skipped: its memory is unknown" in answer["plan"]["notes"]


def test_auto_where_no_mode_can_be_planned_gives_the_cards_422(client: TestClient) -> None:
    publish(client, _on(H100, "node-a", "none", 20))  # B888's memory: nobody measured it
    body = problem(_ask(client, B888), 422, "unknown-card")
    assert "'NVIDIA B888' is not in autobatch's catalogue" in body["detail"]
