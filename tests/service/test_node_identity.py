"""Identity a pod cannot borrow (issue 43): a pod's projected service-account token, reviewed by a
real (fake) Kubernetes API server, publishes as the pod's node only; a static node token is
bound to its node; a revoked token stops working without a restart, within the stated time."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autobatch.errors import ConfigError
from autobatch.store import ProfileStore
from service.fleet.publisher import OutboxPolicy, Publisher
from service.web.auth import FileToken, Grant, parse_token_lines
from service.web.kubernetes_tokens import (
    MAX_KEPT_REVIEWS,
    MAX_REVIEWS_IN_FLIGHT,
    NODE_NAME_EXTRA,
    KubernetesSettings,
    ReviewUnavailable,
    TokenReviewer,
)
from service.web.token_files import RELOAD_CHECK_SECONDS, TokenSource
from tests.service.kube_api import FakeKubeApi, PodToken, fake_kube_api
from tests.service.serving import free_port
from tests.service.test_roles import measured
from tests.service.test_service_api import problem

POD_A = "eyJhbGciOiJSUzI1NiJ9.pod-on-node-a.c2ln"
POD_B = "eyJhbGciOiJSUzI1NiJ9.pod-on-node-b.c2ln"
ADMIN = "adm-5e1d70"


@pytest.fixture
def kube() -> Iterator[FakeKubeApi]:
    with fake_kube_api() as api:
        api.tokens[POD_A] = PodToken(account="default:autobatch", node="node-a")
        api.tokens[POD_B] = PodToken(account="default:autobatch", node="node-b")
        yield api


def credentials(tmp_path: Path, token: str = "central-sa-token") -> Path:
    """The central service's own in-cluster credentials directory (no CA: the fake is HTTP)."""
    folder = tmp_path / "serviceaccount"
    folder.mkdir(exist_ok=True)
    (folder / "token").write_text(token + "\n")
    return folder


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(params=["sqlite", "postgresql"])
def central(
    request: pytest.FixtureRequest,
    make_app: Callable[..., FastAPI],
    tmp_path: Path,
    kube: FakeKubeApi,
) -> TestClient:
    """A central service that reviews pods' tokens with ``kube``, on each backend."""
    store = str(tmp_path / "central.sqlite3")
    if request.param == "postgresql":
        store = request.getfixturevalue("postgres_url")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"admin {ADMIN}  # operators\n")
    app = make_app(
        store_path=store,
        api_tokens_file=tokens,
        kubernetes_api_url=kube.url,
        kubernetes_service_accounts="default:autobatch",
        kubernetes_credentials_dir=credentials(tmp_path),
    )
    return TestClient(app)


def test_a_pods_token_publishes_for_its_own_node_only(
    central: TestClient, kube: FakeKubeApi
) -> None:
    own = central.post("/v1/profiles", json=measured("node-a", 32).to_dict(), headers=bearer(POD_A))
    assert own.status_code == 201, own.text
    forged = measured("node-b", 64).to_dict()  # a line within its card (arrival checks)
    body = problem(
        central.post("/v1/profiles", json=forged, headers=bearer(POD_A)), 403, "wrong-node"
    )
    assert "'node-a'" in body["detail"] and "'node-b'" in body["detail"]
    assert central.post("/v1/profiles", json=forged, headers=bearer(POD_B)).status_code == 201
    listed = central.get("/v1/profiles", headers=bearer(POD_B)).json()["profiles"]  # read too
    assert sorted(p["profile"]["node_name"] for p in listed) == ["node-a", "node-b"]
    # a pod may not delete, and the admin's static token still works beside the reviews
    profile_id = own.json()["id"]
    assert central.delete(f"/v1/profiles/{profile_id}", headers=bearer(POD_A)).status_code == 403
    assert central.delete(f"/v1/profiles/{profile_id}", headers=bearer(ADMIN)).status_code == 204
    (review, *_) = kube.reviews
    assert review["authorization"] == "Bearer central-sa-token"  # the service's own credential
    assert review["body"]["spec"] == {"token": POD_A, "audiences": ["autobatch"]}
    assert len(kube.reviews) == 2  # one per pod token: the others came from the cache


@pytest.mark.parametrize(
    "token",
    [
        PodToken(account="default:other", node="node-a"),  # another service account
        PodToken(account="default:autobatch", node="node-a", audience="vault"),  # another audience
        PodToken(account="default:autobatch", node=None),  # bound to no pod: no node
    ],
    ids=["account", "audience", "no-node"],
)
def test_a_token_the_review_does_not_bind_to_our_pods_is_refused(
    make_app: Callable[..., FastAPI], tmp_path: Path, kube: FakeKubeApi, token: PodToken
) -> None:
    kube.tokens["eyJ.other.sig"] = token
    app = make_app(
        kubernetes_api_url=kube.url,
        kubernetes_service_accounts="default:autobatch",
        kubernetes_credentials_dir=credentials(tmp_path),
    )
    with TestClient(app) as client:
        answer = client.post(
            "/v1/profiles", json=measured("node-a", 32).to_dict(), headers=bearer("eyJ.other.sig")
        )
        problem(answer, 401, "unauthorized")
        unknown = client.get("/v1/profiles", headers=bearer("eyJ.unknown.sig"))
        problem(unknown, 401, "unauthorized")
        problem(client.get("/v1/profiles", headers=bearer("not-a-jwt")), 401, "unauthorized")
    assert [r["body"]["spec"]["token"] for r in kube.reviews] == [
        "eyJ.other.sig",
        "eyJ.unknown.sig",
    ]


def test_an_api_server_that_cannot_review_is_a_503_to_retry(
    make_app: Callable[..., FastAPI], tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"admin {ADMIN}\n")
    app = make_app(
        api_tokens_file=tokens,
        kubernetes_api_url=f"http://127.0.0.1:{free_port()}",  # nothing listens there
        kubernetes_service_accounts="default:autobatch",
        kubernetes_credentials_dir=credentials(tmp_path),
    )
    with TestClient(app) as client:
        answer = client.get("/v1/profiles", headers=bearer(POD_A))
        body = problem(answer, 503, "identity-unavailable")
        assert answer.headers["Retry-After"] and "Kubernetes API server" in body["detail"]
        assert client.get("/v1/profiles", headers=bearer(ADMIN)).status_code == 200


def test_a_review_is_kept_30_s_then_asked_again(kube: FakeKubeApi, tmp_path: Path) -> None:
    """A pod deleted (its token revoked) stops publishing within the cache's 30 s."""
    now = [100.0]
    settings = KubernetesSettings(
        api_url=kube.url,
        service_accounts=frozenset({"default:autobatch"}),
        credentials_dir=credentials(tmp_path),
    )
    reviewer = TokenReviewer(settings, clock=lambda: now[0])
    first = asyncio.run(reviewer.review(POD_A.encode()))
    assert first is not None and (first.role, first.node) == ("publish", "node-a")
    del kube.tokens[POD_A]  # the pod is deleted: its token no longer authenticates
    now[0] += 29.9
    assert asyncio.run(reviewer.review(POD_A.encode())) == first
    now[0] += 0.2
    assert asyncio.run(reviewer.review(POD_A.encode())) is None
    assert len(kube.reviews) == 2


def test_a_flood_of_made_up_tokens_waits_on_few_reviews(kube: FakeKubeApi, tmp_path: Path) -> None:
    settings = KubernetesSettings(
        api_url=kube.url,
        service_accounts=frozenset({"default:autobatch"}),
        credentials_dir=credentials(tmp_path),
    )
    reviewer = TokenReviewer(settings)
    kube.release.clear()  # the API server holds every review

    async def flood() -> list[Grant | BaseException | None]:
        held = [
            asyncio.create_task(reviewer.review(f"eyJ.made-up-{n}.sig".encode()))
            for n in range(MAX_REVIEWS_IN_FLIGHT)
        ]
        while len(kube.reviews) < MAX_REVIEWS_IN_FLIGHT:
            await asyncio.sleep(0.01)
        with pytest.raises(ReviewUnavailable, match="refused rather than queued"):
            await reviewer.review(b"eyJ.one-more.sig")
        kube.release.set()
        return await asyncio.gather(*held, return_exceptions=True)

    assert asyncio.run(flood()) == [None] * MAX_REVIEWS_IN_FLIGHT  # unknown: not authenticated
    assert len(kube.reviews) == MAX_REVIEWS_IN_FLIGHT
    assert asyncio.run(reviewer.review(POD_A.encode())) is not None  # the count went back down


def test_a_flood_of_refused_tokens_does_not_stop_real_tokens_being_kept() -> None:
    settings = KubernetesSettings(
        api_url="https://kubernetes.invalid", service_accounts=frozenset({"default:autobatch"})
    )
    reviewer = TokenReviewer(settings, clock=lambda: 100.0)
    real = b"eyJ.real-pod-token.sig"
    asked: list[bytes] = []

    async def post(token: bytes) -> dict[str, Any]:
        asked.append(token)
        if token != real:
            return {"authenticated": False}
        return {
            "authenticated": True,
            "audiences": ["autobatch"],
            "user": {
                "username": "system:serviceaccount:default:autobatch",
                "extra": {NODE_NAME_EXTRA: ["node-a"]},
            },
        }

    reviewer._post = post  # type: ignore[method-assign]

    async def run() -> None:
        for n in range(10_000):
            assert await reviewer.review(f"eyJ.made-up-{n}.sig".encode()) is None
        for _ in range(3):
            assert await reviewer.review(real) is not None

    asyncio.run(run())
    assert asked.count(real) == 1  # kept after the flood: asked once, not at every request
    asked.clear()

    async def again() -> None:  # the refusals are kept too, MAX_KEPT_REVIEWS at most
        assert await reviewer.review(f"eyJ.made-up-{9_999}.sig".encode()) is None
        assert await reviewer.review(f"eyJ.made-up-{0}.sig".encode()) is None

    asyncio.run(again())
    assert asked == ([] if MAX_KEPT_REVIEWS >= 10_000 else [b"eyJ.made-up-0.sig"])


def test_kubernetes_settings_name_the_accounts_or_fail_at_start(
    make_app: Callable[..., FastAPI], tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="AUTOBATCH_KUBERNETES_SERVICE_ACCOUNTS names no"):
        make_app(kubernetes_api_url="https://kubernetes.default.svc")
    with pytest.raises(ConfigError, match="entry 'autobatch' is not NAMESPACE:NAME"):
        make_app(
            kubernetes_api_url="https://kubernetes.default.svc",
            kubernetes_service_accounts="default:autobatch, autobatch",
        )


# -- static tokens: bound to a node, reloaded --------------------------------------------------


def test_a_tokens_file_takes_inline_comments() -> None:
    text = "admin    9f2c0a        # operators\nread 51bb2e #schedulers\npublish:gpu-node-7 0c9d\n"
    grants = parse_token_lines(text, source="t")
    assert [(g.role, g.node, g.token) for g in grants] == [
        ("admin", None, b"9f2c0a"),
        ("read", None, b"51bb2e"),
        ("publish", "gpu-node-7", b"0c9d"),
    ]
    service_md = (Path(__file__).parents[2] / "docs" / "service.md").read_text()
    shown = service_md.split("ROLE[:NODE] TOKEN` (blank lines")[1].split("```text\n")[1]
    documented = parse_token_lines(shown.split("```")[0], source="docs/service.md")
    assert [(g.role, g.node) for g in documented] == [
        ("admin", None),
        ("read", None),
        ("publish", "gpu-node-7"),
    ]


def test_a_revoked_token_stops_within_the_check_interval(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "tokens"
    path.write_text("publish:node-a pub-a\npublish:node-b pub-b\n")
    source = TokenSource(api_token=None, tokens_file=path, clock=lambda: now[0])
    assert source.current().identify("Bearer pub-a") is not None
    path.write_text("publish:node-b pub-b\npublish:node-a pub-a2\n")  # pub-a revoked, rotated
    now[0] += RELOAD_CHECK_SECONDS - 0.1
    assert source.current().identify("Bearer pub-a") is not None  # not looked at yet
    now[0] += 0.1
    assert source.current().identify("Bearer pub-a") is None
    grant = source.current().identify("Bearer pub-a2")
    assert grant is not None and grant.node == "node-a"
    assert RELOAD_CHECK_SECONDS <= 5  # the bound docs/service.md states


def test_a_broken_file_keeps_the_last_good_tokens_and_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    path = tmp_path / "tokens"
    path.write_text("admin adm-1\n")
    source = TokenSource(api_token=None, tokens_file=path, clock=lambda: now[0])
    path.write_text("admin adm-2 extra-word\n")
    now[0] += RELOAD_CHECK_SECONDS
    with caplog.at_level(logging.ERROR, logger="service.auth"):
        assert source.current().identify("Bearer adm-1") is not None
    (record,) = caplog.records
    assert "line 1: expected two words" in record.getMessage()
    assert "adm-2" not in record.getMessage() and "last good" in record.getMessage()
    path.unlink()
    now[0] += RELOAD_CHECK_SECONDS
    assert source.current().identify("Bearer adm-1") is not None
    path.write_text("")  # emptied: every call is refused, the API does not open
    now[0] += RELOAD_CHECK_SECONDS
    assert source.current().identify("Bearer adm-1") is None and bool(source)


@pytest.mark.parametrize("as_directory", [False, True])
def test_a_token_file_rewritten_during_a_reload_keeps_its_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, as_directory: bool
) -> None:
    # A writer truncates the file (open(..., "w")) just after the reload's first read of it,
    # and writes the same text back after the reload: what was hashed is what is parsed, so
    # the tokens stay (parsing a second read took the empty file's, until the next change).
    now = [0.0]
    folder = tmp_path / "secret"
    folder.mkdir()
    path = folder / "admin" if as_directory else tmp_path / "tokens"
    text = "adm-1\n" if as_directory else "admin adm-1\nread rd-1\n"
    path.write_text(text)
    source = TokenSource(
        api_token=None, tokens_file=folder if as_directory else path, clock=lambda: now[0]
    )
    changed = "adm-1 \n" if as_directory else text + "read rd-2\n"
    path.write_text(changed)  # a change, so the next look reloads
    real_read_bytes = Path.read_bytes

    def read_then_truncated(self: Path) -> bytes:
        data = real_read_bytes(self)
        if self == path:
            self.write_text("")
        return data

    now[0] += RELOAD_CHECK_SECONDS
    with monkeypatch.context() as patch:
        patch.setattr(Path, "read_bytes", read_then_truncated)
        source.current()
    path.write_text(changed)  # the writer's write of the same text
    for _ in range(3):  # later looks, the file unchanged since
        now[0] += RELOAD_CHECK_SECONDS
        assert source.current().identify("Bearer adm-1") is not None


def test_a_server_drops_a_revoked_token_without_a_restart(
    make_app: Callable[..., FastAPI], tmp_path: Path
) -> None:
    path = tmp_path / "tokens"
    path.write_text("admin adm-1\nread rd-1\n")
    with TestClient(make_app(api_tokens_file=path)) as client:
        assert client.get("/v1/profiles", headers=bearer("rd-1")).status_code == 200
        path.write_text("admin adm-1\nread rd-2\n")
        written = time.monotonic()
        while client.get("/v1/profiles", headers=bearer("rd-1")).status_code == 200:
            assert time.monotonic() - written < 5.0, "rd-1 still works 5 s after its revocation"
            time.sleep(0.1)
        assert client.get("/v1/profiles", headers=bearer("rd-2")).status_code == 200


def test_a_nodes_token_file_is_read_for_each_request(tmp_path: Path) -> None:
    """A projected token rotates under the sidecar: each publish sends the file's current one."""
    path = tmp_path / "token"
    path.write_text("eyJ.first.sig\n")
    token = FileToken(path)
    assert token() == "eyJ.first.sig"
    path.write_text("eyJ.rotated.sig\n")
    assert token() == "eyJ.rotated.sig"
    path.unlink()  # between the kubelet's remove and write: the last one read
    assert token() == "eyJ.rotated.sig"


def test_a_sidecar_publishes_with_its_rotating_pod_token_as_its_node_only(
    make_app: Callable[..., FastAPI], tmp_path: Path, kube: FakeKubeApi
) -> None:
    """End to end: the node's outbox reads its projected token for each request; the central
    service reviews it and stores the node's own profiles, and refuses another node's."""
    from tests.service.test_deletions import served

    central_app = make_app(
        kubernetes_api_url=kube.url,
        kubernetes_service_accounts="default:autobatch",
        kubernetes_credentials_dir=credentials(tmp_path),
        kubernetes_review_cache_seconds=0,  # each publish reviewed: the rotation is seen
    )
    token_file = tmp_path / "projected-token"
    token_file.write_text(POD_A + "\n")
    policy = OutboxPolicy(base_delay_seconds=0.05, max_delay_seconds=0.1, timeout_seconds=5)
    with ProfileStore(tmp_path / "node.sqlite3") as store, served(central_app) as url:
        central: ProfileStore = central_app.state.service.store
        publisher = Publisher(url, token=FileToken(token_file), store=store, policy=policy)
        publisher.open()
        try:
            publisher.submit(measured("node-a", 32))
            wait_for(lambda: len(central.list_profiles()) == 1)
            rotated = "eyJhbGciOiJSUzI1NiJ9.pod-on-node-a-rotated.c2ln"
            kube.tokens[rotated] = kube.tokens.pop(POD_A)  # the kubelet rotated the token
            token_file.write_text(rotated + "\n")
            publisher.submit(measured("node-a", 16))
            wait_for(lambda: len(central.list_profiles()) == 2)
            publisher.submit(measured("node-b", 512))  # a profile naming another node
            wait_for(lambda: "wrong-node" in "".join(e.last_error for e in store.outbox.entries()))
        finally:
            publisher.close()
    assert sorted(p.max_micro_batch_size for _, p in central.list_profiles()) == [16, 32]
    assert [r["body"]["spec"]["token"] for r in kube.reviews][:2] == [POD_A, rotated]


def wait_for(condition: Callable[[], bool], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within 20 s"
        time.sleep(0.05)
