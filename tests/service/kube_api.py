"""A small real Kubernetes API server for tests: it answers ``POST
/apis/authentication.k8s.io/v1/tokenreviews`` as kube-apiserver does, from a table of pod tokens
that a test fills (and revokes), and refuses a caller without the service's own credential."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REVIEW_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"


@dataclasses.dataclass
class PodToken:
    """What the API server knows of a projected service-account token."""

    account: str
    """``NAMESPACE:NAME`` of its service account."""
    node: str | None
    """The node of the pod it is bound to; None for a token bound to no pod."""
    audience: str = "autobatch"


@dataclasses.dataclass
class FakeKubeApi:
    url: str
    caller_token: str
    """The bearer token a caller must send (the central service's own service account)."""
    tokens: dict[str, PodToken] = dataclasses.field(default_factory=dict)
    reviews: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """Each review's request body and the caller's Authorization, in order."""
    release: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Reviews are answered once this is set (set from the start; a test clears it to hold
    them)."""

    def __post_init__(self) -> None:
        self.release.set()

    def status_of(self, spec: dict[str, Any]) -> dict[str, Any]:
        """The TokenReview status kube-apiserver would answer for ``spec``."""
        known = self.tokens.get(spec.get("token", ""))
        wanted = spec.get("audiences") or ["https://kubernetes.default.svc"]
        if known is None:
            return {"authenticated": False, "user": {}, "error": "invalid bearer token"}
        if known.audience not in wanted:
            return {"authenticated": False, "user": {}, "error": "token audiences are invalid"}
        namespace, name = known.account.split(":")
        extra = {"authentication.kubernetes.io/credential-id": ["JTI=0a1b"]}
        if known.node is not None:
            extra["authentication.kubernetes.io/pod-name"] = [f"{name}-x7k2p"]
            extra["authentication.kubernetes.io/node-name"] = [known.node]
        user = {
            "username": f"system:serviceaccount:{namespace}:{name}",
            "uid": "5f0e0c64-0000-4000-8000-000000000000",
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}"],
            "extra": extra,
        }
        return {"authenticated": True, "user": user, "audiences": [known.audience]}


def _handler(api: FakeKubeApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            authorization = self.headers.get("Authorization")
            api.reviews.append({"body": body, "authorization": authorization})
            api.release.wait(10)
            if self.path != REVIEW_PATH:
                self._answer(404, {"kind": "Status", "reason": "NotFound"})
            elif authorization != f"Bearer {api.caller_token}":
                self._answer(401, {"kind": "Status", "reason": "Unauthorized"})
            else:
                self._answer(201, {**body, "status": api.status_of(body["spec"])})

        def _answer(self, status: int, data: dict[str, Any]) -> None:
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return

    return Handler


@contextmanager
def fake_kube_api(caller_token: str = "central-sa-token") -> Iterator[FakeKubeApi]:
    """The fake API server on a free loopback port, for the ``with`` block."""
    api = FakeKubeApi(url="", caller_token=caller_token)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(api))
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
