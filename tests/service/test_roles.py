"""Roles per token (``service.web.auth``): who may plan, publish as which node, delete; on SQLite
and PostgreSQL. Tokens trimmed on the server and in every client; the Host check of a tokenless
loopback server."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.client import AutobatchClient, publish_profile
from autobatch.errors import ConfigError
from autobatch.profile import Profile, Trial
from service.web.auth import Tokens, host_allowed, load_tokens, parse_token_lines, required_role
from tests.helpers.fake_pynvml import GiB
from tests.service.serving import serving
from tests.service.test_client import transport_for
from tests.service.test_service_api import call_asgi, make_profile, problem

A100 = "NVIDIA A100-SXM4-80GB"
TOKENS = {
    "admin": "adm-7f3a9c",
    "read": "rd-51bb2e",
    "node-a": "pub-a-0c9d11",
    "node-b": "pub-b-88e0f4",
}
TOKENS_FILE = f"""# role[:node] token
admin {TOKENS["admin"]}
read {TOKENS["read"]}\r
publish:node-a   {TOKENS["node-a"]}

publish:node-b\t{TOKENS["node-b"]}
"""


@pytest.fixture(params=["sqlite", "postgresql"])
def store_path(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store on each backend (PostgreSQL: a throwaway database, ``tests/helpers/postgres``)."""
    if request.param == "postgresql":
        url: str = request.getfixturevalue("postgres_url")
        return url
    return str(tmp_path / "roles.sqlite3")


@pytest.fixture
def fleet(make_app: Callable[..., FastAPI], tmp_path: Path, store_path: str) -> TestClient:
    """A central service with the four tokens of :data:`TOKENS`, from a file."""
    path = tmp_path / "tokens"
    path.write_text(TOKENS_FILE)
    return TestClient(make_app(api_tokens_file=path, store_path=store_path))


def auth(who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[who]}"}


def measured(node: str, max_micro_batch_size: int) -> Profile:
    """A profile of ``fp-gpt2`` on an A100 whose largest fitting micro-batch is the given one."""
    return make_profile(
        node_name=node,
        max_micro_batch_size=max_micro_batch_size,
        recommended_micro_batch_size=max_micro_batch_size,
        trials=(
            Trial(micro_batch_size=max_micro_batch_size, fits=True, peak_allocated_bytes=20 * GiB),
        ),
    )


def planned_max(client: TestClient, **target: str) -> int:
    body = {"model_fingerprint": "fp-gpt2", "effective_batch_size": 1024, **target}
    response = client.post("/v1/plan", json=body, headers=auth("read"))
    assert response.status_code == 200, response.text
    value: int = response.json()["plan"]["max_micro_batch_size"]
    return value


# -- the matrix ---------------------------------------------------------------------------------

ROUTES: list[tuple[str, str]] = [
    ("POST", "/v1/plan"),
    ("GET", "/v1/profiles"),
    ("GET", "/v1/profiles/{id}"),
    ("GET", "/v1/profile-summaries"),
    ("GET", "/v1/devices"),
    ("GET", "/v1/probes"),
    ("GET", "/v1/probes/{probe_id}"),  # a run nobody started: 404 once allowed
    ("GET", "/v1/profiles/{id}/report"),
    ("GET", "/v1/profile-deletions?after=0"),
    ("POST", "/v1/admissions"),
    ("POST", "/v1/profiles"),  # a profile of node-a
    ("POST", "/v1/probes"),  # a model the registry does not hold: 404 once allowed
    ("DELETE", "/v1/profiles/{id}"),
]
EXPECTED = {  # who -> the status of each route above, in order
    "admin": [200, 200, 200, 200, 200, 200, 404, 200, 200, 200, 201, 404, 204],
    "node-a": [200, 200, 200, 200, 200, 200, 404, 200, 200, 200, 201, 403, 403],
    # node-b: node-a's profile is not its own to publish
    "node-b": [200, 200, 200, 200, 200, 200, 404, 200, 200, 200, 403, 403, 403],
    "read": [200, 200, 200, 200, 200, 200, 404, 200, 200, 200, 403, 403, 403],
    "nobody": [401] * len(ROUTES),
    "wrong": [401] * len(ROUTES),
}


def test_the_role_matrix_covers_every_route_of_the_api(fleet: TestClient) -> None:
    # A route added without a row here would go unchecked for its roles (the API's routes as
    # its OpenAPI document lists them).
    paths = fleet.get("/openapi.json").json()["paths"]
    served = {
        (method.upper(), path.replace("{profile_id}", "{id}"))
        for path, operations in paths.items()
        if path.startswith("/v1/")
        for method in operations
    }
    assert served == {(method, path.partition("?")[0]) for method, path in ROUTES}


def test_each_role_on_each_route(fleet: TestClient) -> None:
    profile = measured("node-a", 32)
    bodies: dict[tuple[str, str], Any] = {
        ("POST", "/v1/plan"): {"max_micro_batch_size": 8, "effective_batch_size": 16},
        ("POST", "/v1/profiles"): profile.to_dict(),
        ("POST", "/v1/probes"): {"model": "not-registered"},
        ("POST", "/v1/admissions"): {
            "model_fingerprint": "fp-gpt2",
            "effective_batch_size": 64,
            "world_size": 2,
        },
    }
    seen: dict[str, list[int]] = {}
    seconds = itertools.count()
    for who in EXPECTED:
        special = {"nobody": {}, "wrong": {"Authorization": "Bearer " + TOKENS["admin"][:-1]}}
        headers = special[who] if who in special else auth(who)
        seen[who] = []
        # A profile new to the store, so that a publish allowed is a 201 (a resend is a 200).
        bodies[("POST", "/v1/profiles")] = measured("node-a", 40 + len(seen)).to_dict()
        for method, template in ROUTES:
            # A profile of its own each time: one the DELETE route removed is never stored again.
            stamp = f"2026-12-01T00:00:{next(seconds):02d}Z"
            fresh = dataclasses.replace(profile, created_at=stamp)
            created = fleet.post("/v1/profiles", json=fresh.to_dict(), headers=auth("admin"))
            assert created.status_code == 201, created.text
            path = template.replace("{id}", created.json()["id"])
            path = path.replace("{probe_id}", "0123456789abcdef")
            body = bodies.get((method, template))
            response = fleet.request(method, path, json=body, headers=headers)
            seen[who].append(response.status_code)
            if response.status_code == 403:
                role = required_role(method, template)
                assert f"needs a token with the {role} role" in response.json()["detail"] or (
                    response.json()["type"].endswith("wrong-node")
                )
    assert seen == EXPECTED, json.dumps(seen)


def test_a_node_cannot_publish_for_another_node(fleet: TestClient) -> None:
    """The issue: a holder of the fleet's token published node-b's name with micro-batch 512,
    and plans by model, card and node switched from 32 to 512."""
    real = fleet.post("/v1/profiles", json=measured("node-b", 32).to_dict(), headers=auth("node-b"))
    assert real.status_code == 201
    targets: list[dict[str, str]] = [{}, {"card": A100}, {"node": "node-b"}]
    assert [planned_max(fleet, **target) for target in targets] == [32, 32, 32]

    forged = measured("node-b", 512).to_dict()
    for who in ("node-a", "read"):
        refused = fleet.post("/v1/profiles", json=forged, headers=auth(who))
        assert refused.status_code == 403
    body = problem(
        fleet.post("/v1/profiles", json=forged, headers=auth("node-a")), 403, "wrong-node"
    )
    assert "as node 'node-a' only" in body["detail"] and "'node-b'" in body["detail"]
    assert "set AUTOBATCH_NODE_NAME (or NODE_NAME) to its name" in body["detail"]
    assert body["errors"][0]["field"] == "body.node_name"
    assert [planned_max(fleet, **target) for target in targets] == [32, 32, 32]

    again = fleet.post(
        "/v1/profiles", json=measured("node-b", 32).to_dict(), headers=auth("node-b")
    )
    assert (again.status_code, again.json()["id"]) == (200, real.json()["id"])  # a resend
    listed = fleet.get("/v1/profiles", headers=auth("read")).json()["profiles"]
    assert [p["profile"]["max_micro_batch_size"] for p in listed] == [32]


def test_only_admin_can_list_and_delete(fleet: TestClient) -> None:
    ids = [
        fleet.post("/v1/profiles", json=measured(node, 32).to_dict(), headers=auth(node)).json()[
            "id"
        ]
        for node in ("node-a", "node-b")
    ]
    for who in ("read", "node-a", "node-b"):
        listed = fleet.get("/v1/profiles", headers=auth(who)).json()["profiles"]
        assert sorted(p["id"] for p in listed) == sorted(ids)
        for profile_id in ids:
            body = problem(
                fleet.delete(f"/v1/profiles/{profile_id}", headers=auth(who)), 403, "forbidden"
            )
            assert body["detail"].startswith(
                f"DELETE /v1/profiles/{profile_id} needs a token with the admin role"
            )
    assert len(fleet.get("/v1/profiles", headers=auth("read")).json()["profiles"]) == 2
    for profile_id in ids:
        assert fleet.delete(f"/v1/profiles/{profile_id}", headers=auth("admin")).status_code == 204
    assert fleet.get("/v1/profiles", headers=auth("read")).json()["profiles"] == []


def test_the_single_api_token_stays_admin(make_app: Callable[..., FastAPI]) -> None:
    client = TestClient(make_app(api_token="s3cret"))
    created = client.post(
        "/v1/profiles",
        json=measured("any-node", 8).to_dict(),
        headers={"Authorization": "Bearer s3cret"},
    )
    assert created.status_code == 201  # admin publishes under any name
    gone = client.delete(
        f"/v1/profiles/{created.json()['id']}", headers={"Authorization": "Bearer s3cret"}
    )
    assert gone.status_code == 204


# -- configuration ------------------------------------------------------------------------------


def test_tokens_are_trimmed_on_the_server(make_app: Callable[..., FastAPI], tmp_path: Path) -> None:
    # A Secret written with `echo` ends in a newline: the clean token is the one that works.
    client = TestClient(make_app(api_token="s3cret\n"))
    body = {"max_micro_batch_size": 8, "effective_batch_size": 8}
    assert (
        client.post("/v1/plan", json=body, headers={"Authorization": "Bearer s3cret"}).status_code
        == 200
    )
    secret = tmp_path / "secret"
    (secret / "..2026_01_01").mkdir(parents=True)
    for name, token in (("read", "rd\n"), ("publish.node-a", " pub-a\r\n"), ("admin.ops", "adm\n")):
        (secret / "..2026_01_01" / name).write_text(token)
        (secret / name).symlink_to(Path("..data") / name)
    (secret / "..data").symlink_to("..2026_01_01")  # a Kubernetes Secret volume's layout
    tokens = load_tokens(api_token=None, tokens_file=secret)
    assert repr(tokens) == "Tokens(admin, publish as node 'node-a', read)"
    grant = tokens.identify("Bearer pub-a")
    assert grant is not None and (grant.role, grant.node) == ("publish", "node-a")
    assert tokens.identify("Bearer pub-a\r\n") is grant
    assert tokens.identify("Bearer rd ") is not None and tokens.identify("Bearer rdx") is None
    served = TestClient(make_app(api_tokens_file=secret))
    assert (
        served.post("/v1/plan", json=body, headers={"Authorization": "Bearer rd"}).status_code
        == 200
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("s3cret-token read\n", "line 1: the role is not one of read, publish, admin"),
        ("read\n", "line 1: expected two words"),
        ("read a b\n", "line 1: expected two words"),
        ("publish s3cret-token\n", "line 1: a publish token names its node"),
        ("admin:node-a s3cret-token\n", "line 1: a publish token names its node"),
        (
            "# x\nread s3cret-token\nadmin s3cret-token\n",
            r"configured twice \(t line 2 and t line 3\)",
        ),
    ],
)
def test_a_bad_tokens_file_is_named_by_line_never_by_token(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        Tokens(parse_token_lines(text, source="t"))
    assert "s3cret" not in str(caught.value)


def test_tokens_never_show_in_settings_or_errors(
    make_app: Callable[..., FastAPI], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.__main__ import main
    from service.web.settings import Settings

    settings = Settings(
        api_token="adm-s3cret",
        central_api_token="cen-s3cret\n",
        store_path="postgresql://u:pw-s3cret@db/x",
    )
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings)
    assert settings.central_api_token is not None
    assert settings.central_api_token.get_secret_value() == "cen-s3cret"
    bad = tmp_path / "tokens"
    bad.write_text("reader tok-s3cret\n")
    os.environ.pop("AUTOBATCH_API_TOKEN", None)
    assert main(["--api-tokens-file", str(bad), "--store-path", ":memory:"]) == 1
    err = capsys.readouterr().err
    assert "tokens line 1: the role is not one of" in err and "s3cret" not in err
    assert main(["--port", "70000", "--store-path", "postgresql://u:pw/s3@cret@db/x"]) == 2
    err = capsys.readouterr().err
    assert "s3" not in err.replace("--store-path", "") and "cret" not in err


# -- clients ------------------------------------------------------------------------------------


def test_clients_trim_the_token_and_never_show_a_malformed_one(
    make_app: Callable[..., FastAPI],
) -> None:
    app = make_app(api_token="s3cret")
    with AutobatchClient("http://testserver", token="s3cret\n", transport=transport_for(app)) as c:
        assert len(c.list_devices()) == 2
    profile = measured("node-a", 8)
    assert publish_profile(
        "http://testserver", profile, token=" s3cret\n", transport=transport_for(app)
    )
    for malformed in ("s3\ncret", "s3cr\x00et", "s3crét"):
        with pytest.raises(ConfigError, match="the API token is malformed") as caught:
            AutobatchClient("http://testserver", token=malformed)
        assert "cret" not in str(caught.value) and "s3" not in str(caught.value)
        with pytest.raises(ConfigError, match="malformed") as caught:
            publish_profile("http://testserver", profile, token=malformed)
        assert "cret" not in str(caught.value)


def test_plan_env_trims_the_token_and_hides_a_malformed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from autobatch.cli import main

    path = tmp_path / "tokens"
    path.write_text(TOKENS_FILE)
    argv = [
        "plan",
        "--model-fingerprint",
        "fp-gpt2",
        "--card",
        A100,
        "--effective-batch-size",
        "64",
    ]
    with serving(tmp_path, "--api-tokens-file", str(path)) as server:
        server.client.post(
            "/v1/profiles", json=measured("node-a", 32).to_dict(), headers=auth("node-a")
        ).raise_for_status()
        monkeypatch.setenv("AUTOBATCH_API_TOKEN", TOKENS["read"] + "\n")  # from `echo`
        code = main([*argv, "--service", f"http://127.0.0.1:{server.port}", "--env"])
        out, err = capsys.readouterr()
        assert (code, err) == (0, "") and "AUTOBATCH_MICRO_BATCH_SIZE=32" in out
        monkeypatch.setenv("AUTOBATCH_API_TOKEN", "s3\ncret")
        code = main([*argv, "--service", f"http://127.0.0.1:{server.port}", "--env"])
        out, err = capsys.readouterr()
        assert code == 1 and "the API token is malformed" in err
        assert "cret" not in err and "s3" not in err


def test_a_tokenless_loopback_server_answers_v1_only_to_loopback_names(tmp_path: Path) -> None:
    """DNS rebinding: a web page whose name now resolves to 127.0.0.1 sends its own Host."""
    with serving(tmp_path) as server:
        base = f"http://127.0.0.1:{server.port}"
        body = {"max_micro_batch_size": 8, "effective_batch_size": 8}
        for host in ("127.0.0.1", f"127.0.0.1:{server.port}", f"localhost:{server.port}", "[::1]"):
            assert (
                httpx.post(base + "/v1/plan", json=body, headers={"Host": host}).status_code == 200
            )
        for host in (
            "evil.example",
            f"evil.example:{server.port}",
            "127.0.0.1.evil.example",
            f"localhost:{server.port}@evil.com",
        ):
            refused = httpx.post(base + "/v1/plan", json=body, headers={"Host": host})
            problem(refused, 403, "host-not-allowed")
        assert httpx.get(base + "/healthz", headers={"Host": "evil.example"}).status_code == 200


def test_the_host_check_only_guards_a_tokenless_loopback_server(
    make_app: Callable[..., FastAPI],
) -> None:
    open_app, closed_app = make_app(), make_app(api_token="s3cret")
    evil = [(b"host", b"rebound.example")]
    assert call_asgi(open_app, "GET", "/v1/profiles", evil, [b""])[0] == 403
    assert (
        call_asgi(open_app, "GET", "/v1/profiles", [(b"host", b"localhost:8000")], [b""])[0] == 200
    )
    assert call_asgi(open_app, "GET", "/healthz", evil, [b""])[0] == 200
    with_token = [*evil, (b"authorization", b"Bearer s3cret")]
    assert call_asgi(closed_app, "GET", "/v1/profiles", with_token, [b""])[0] == 200
    # Off loopback (a pod IP, the test client's "testserver") there is nothing to rebind.
    assert TestClient(open_app).get("/v1/profiles", headers={"Host": "evil"}).status_code == 200


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("localhost", True),
        ("LOCALHOST:8000", True),
        ("127.0.0.1:80", True),
        ("[::1]:8000", True),
        ("[::1]", True),
        ("127.0.0.2", False),
        ("localhost.evil", False),
        ("evil:127.0.0.1", False),
        ("localhost:8000@evil.com", False),
        ("localhost@evil.com", False),
        ("user@localhost:8000", False),
        ("user:pw@localhost", False),
        ("localhost:8000/path", False),
        ("localhost/evil", False),
        ("localhost:8000:9000", False),
        ("localhost:", False),
        ("localhost:http", False),
        ("[::1]evil.com", False),
        ("[::1]:8000@evil.com", False),
        ("[::1", False),
        ("::1:8000", False),
        ("local host", False),
        ("", False),
        (None, False),
    ],
)
def test_host_allowed(host: str | None, allowed: bool) -> None:
    assert host_allowed(host) is allowed
