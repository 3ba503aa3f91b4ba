"""The manifests under ``deploy/``: valid against the Kubernetes schemas (the ones
``kubernetes-validate`` bundles, offline), and the two modes as docs/deploy.md describes them:
the node DaemonSet holds no GPU and sees every card, the training pod's sidecar shares the pod's
GPUs and picks none itself; the store is writable by the user the server runs as."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate.utils as kubernetes_validate
import pytest
import yaml

from autobatch.client import publish_profile
from autobatch.conditions import Conditions
from service.__main__ import parse_args
from service.probes.registry import load_registry
from service.web.kubernetes_tokens import service_accounts_of
from service.web.settings import Settings, settings_from_args
from tests.service.serving import free_port
from tests.service.test_container import image_env, instruction
from tests.service.test_service_api import make_profile

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
OLDEST_KUBERNETES = "1.34"
"""The oldest release every manifest's API is in (resource.k8s.io/v1, Dynamic Resource
Allocation, is GA in 1.34; native sidecars, initContainers with restartPolicy Always, in 1.33)."""


def documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kinds(path: Path) -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in documents(path)}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def autobatch_container(pod: dict[str, Any]) -> dict[str, Any]:
    """The container running ``autobatch serve`` (a container or a native sidecar)."""
    (found,) = [
        container
        for container in [*pod.get("initContainers", []), *pod["containers"]]
        if container.get("args", [])[:2] == ["autobatch", "serve"]
    ]
    return found


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in container["env"]}


def gpu_resources(container: dict[str, Any]) -> list[str]:
    resources = container.get("resources", {})
    return [
        name
        for part in ("requests", "limits")
        for name in resources.get(part, {})
        if name.startswith("nvidia.com/")
    ]


def run_as(pod: dict[str, Any], container: dict[str, Any]) -> tuple[int, int]:
    """(uid, gid) the container runs as: its securityContext, the pod's, else the image's USER."""
    uid, _, gid = instruction("USER").partition(":")
    merged = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    return int(merged.get("runAsUser", uid)), int(merged.get("runAsGroup", gid))


def store_is_writable_by(pod: dict[str, Any], container: dict[str, Any]) -> str:
    """Why the store's volume is writable by the container's user, or an AssertionError.

    A hostPath directory is created root-owned and ``fsGroup`` does not apply to it: an
    initContainer must hand it over (``chown uid:gid``, as root with CAP_CHOWN). An emptyDir or
    a claim gets the pod's ``fsGroup``, which must be the container's group."""
    store_dir = str(Path(image_env()["AUTOBATCH_STORE"]).parent)
    uid, gid = run_as(pod, container)
    assert uid != 0
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == store_dir]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    if "hostPath" in volume:
        for init in pod.get("initContainers", []):
            mounted = {m["name"]: m["mountPath"] for m in init.get("volumeMounts", [])}
            command = init.get("command", [])
            context = init.get("securityContext", {})
            if (
                mounted.get(volume["name"]) in command
                and command[0] == "chown"
                and f"{uid}:{gid}" in command
                and context.get("runAsUser") == 0
                and "CHOWN" in context.get("capabilities", {}).get("add", [])
            ):
                return f"hostPath handed to {uid}:{gid} by initContainer {init['name']}"
        raise AssertionError(f"hostPath {volume['hostPath']} stays root-owned: uid {uid} fails")
    assert {"emptyDir", "persistentVolumeClaim", "ephemeral"} & set(volume), volume
    assert pod["securityContext"]["fsGroup"] == gid, "the volume's group must be the user's"
    return f"{set(volume) - {'name'}} with fsGroup {gid}"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
@pytest.mark.parametrize("version", [OLDEST_KUBERNETES, "latest"])
def test_manifests_are_valid_kubernetes(path: Path, version: str) -> None:
    """Strict: an unknown or misplaced field fails, as ``kubectl apply --validate=strict`` does.
    The schemas ship inside kubernetes-validate; nothing is fetched."""
    target = kubernetes_validate.latest_version() if version == "latest" else version
    for document in documents(path):
        kubernetes_validate.validate(document, target, strict=True)


def test_the_schema_check_catches_a_misplaced_field() -> None:
    daemonset = kinds(DEPLOY / "daemonset.yaml")["DaemonSet"]
    pod_spec(daemonset)["runtimeClass"] = "nvidia"  # runtimeClassName, misspelt
    with pytest.raises(kubernetes_validate.ValidationError, match="runtimeClass"):
        kubernetes_validate.validate(daemonset, OLDEST_KUBERNETES, strict=True)


def test_node_daemonset_holds_no_gpu_and_sees_every_card() -> None:
    manifest = kinds(DEPLOY / "daemonset.yaml")
    pod = pod_spec(manifest["DaemonSet"])
    container = autobatch_container(pod)
    assert pod["runtimeClassName"] == "nvidia"
    assert env_of(container)["NVIDIA_VISIBLE_DEVICES"] == "all"
    for each in [*pod.get("initContainers", []), *pod["containers"]]:
        assert gpu_resources(each) == [] and "claims" not in each.get("resources", {})
    assert "resourceClaims" not in pod
    settings = settings_from_args(parse_args(container["args"][2:]))
    assert settings.require_gpu and settings.host == "0.0.0.0"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "hostPath" in store_is_writable_by(pod, container)
    assert env_of(container)["AUTOBATCH_API_TOKEN"]["secretKeyRef"]["name"] == "autobatch-token"


def test_node_daemonset_registry_loads(tmp_path: Path) -> None:
    manifest = kinds(DEPLOY / "daemonset.yaml")
    container = autobatch_container(pod_spec(manifest["DaemonSet"]))
    settings = settings_from_args(parse_args(container["args"][2:]))
    assert settings.config_file is not None
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "models"]
    assert settings.config_file.parent == Path(mount["mountPath"])
    registry = tmp_path / settings.config_file.name
    registry.write_text(manifest["ConfigMap"]["data"][settings.config_file.name])
    assert load_registry(registry).models == {}


def test_training_pod_sidecar_shares_the_pods_gpus_and_picks_none() -> None:
    manifest = kinds(DEPLOY / "training-pod.yaml")
    pod = pod_spec(manifest["Job"])
    sidecar = autobatch_container(pod)
    # A native sidecar: it starts before the trainer and does not keep the Job from completing.
    assert sidecar in pod["initContainers"] and sidecar["restartPolicy"] == "Always"
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(sidecar)
    (trainer,) = pod["containers"]
    claims = {claim["name"] for claim in sidecar["resources"]["claims"]}
    assert claims and claims == {claim["name"] for claim in trainer["resources"]["claims"]}
    (pod_claim,) = pod["resourceClaims"]
    template = manifest["ResourceClaimTemplate"]
    assert pod_claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    assert gpu_resources(sidecar) == [] and gpu_resources(trainer) == []
    assert settings_from_args(parse_args(sidecar["args"][2:])).require_gpu
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert "emptyDir" in store_is_writable_by(pod, sidecar)


def test_a_root_owned_host_path_is_refused() -> None:
    """A DaemonSet without the init container (uid 10001 on a DirectoryOrCreate hostPath, nothing
    handing it over): the server cannot open its store and the pod crash-loops."""
    pod = pod_spec(kinds(DEPLOY / "daemonset.yaml")["DaemonSet"])
    pod.pop("initContainers")
    with pytest.raises(AssertionError, match="stays root-owned"):
        store_is_writable_by(pod, autobatch_container(pod))


@pytest.mark.parametrize(
    "path", [*MANIFESTS, ROOT / "Dockerfile", DEPLOY / "Dockerfile.models"], ids=lambda p: p.name
)
def test_files_the_comments_name_exist(path: Path) -> None:
    comments = "\n".join(
        line.split("#", 1)[1] for line in path.read_text().splitlines() if "#" in line
    )
    named = re.findall(r"\b((?:[\w.-]+/)+[\w.-]+\.(?:py|toml|md|yaml))\b", comments)
    # Paths into this repository (a user's own, "mymodels/__init__.py", are examples).
    ours = [name for name in named if (ROOT / name.split("/")[0]).is_dir()]
    assert ours, "expected the comments to point somewhere"
    for name in ours:
        assert (ROOT / name).exists(), f"{path.name} names {name}, which does not exist"


# -- central mode --------------------------------------------------------------------------------


def test_central_deployment_is_replicated_on_the_shared_store_and_disruption_safe() -> None:
    manifest = kinds(DEPLOY / "central.yaml")
    deployment, service, budget = (
        manifest["Deployment"],
        manifest["Service"],
        manifest["PodDisruptionBudget"],
    )
    assert deployment["spec"]["replicas"] >= 2
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    pod = pod_spec(deployment)
    container = autobatch_container(pod)
    store = env_of(container)["AUTOBATCH_STORE"]["secretKeyRef"]
    assert store == {"name": "autobatch-store", "key": "AUTOBATCH_STORE"}
    settings = settings_from_args(parse_args(container["args"][2:]))
    assert settings.host == "0.0.0.0" and not settings.require_gpu  # no GPU, no NVIDIA runtime
    assert "runtimeClassName" not in pod and gpu_resources(container) == []
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port = service["spec"]["ports"][0]
    assert port["targetPort"] == container["ports"][0]["name"] and port["port"] == settings.port


def test_node_daemonset_publishes_to_the_central_service() -> None:
    container = autobatch_container(pod_spec(kinds(DEPLOY / "daemonset.yaml")["DaemonSet"]))
    central = kinds(DEPLOY / "central.yaml")["Service"]
    url = env_of(container)["AUTOBATCH_CENTRAL_URL"]
    assert url == f"http://{central['metadata']['name']}:{central['spec']['ports'][0]['port']}"


def secret_files(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, list[str]]:
    """Each Secret-backed mount of ``container``: its path and the Secrets whose keys it holds."""
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        sources = volume.get("projected", {}).get("sources", [{"secret": volume.get("secret")}])
        names = [
            s["secret"].get("name") or s["secret"]["secretName"] for s in sources if s.get("secret")
        ]
        if names:
            mounts[mount["mountPath"]] = names
    return mounts


def test_tokens_reach_each_workload_as_files_with_their_roles(tmp_path: Path) -> None:
    """The central service reads admin and read tokens from the Secret; a node's sidecar holds
    no Secret, only its pod's own audience-bound token, which the central service reviews as
    publish for that pod's node; the training Job's init container holds read."""
    from service.web.auth import load_tokens

    manifest = kinds(DEPLOY / "central.yaml")
    central = pod_spec(manifest["Deployment"])
    central_env = env_of(autobatch_container(central))
    assert "AUTOBATCH_API_TOKEN" not in central_env
    tokens_dir = central_env["AUTOBATCH_API_TOKENS_FILE"]
    assert secret_files(central, autobatch_container(central)) == {tokens_dir: ["autobatch-tokens"]}
    settings = Settings(
        **{name.removeprefix("AUTOBATCH_").lower(): value for name, value in central_env.items()
           if isinstance(value, str)}
    )  # fmt: skip
    assert settings.kubernetes_api_url == "https://kubernetes.default.svc"
    binding = manifest["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == "system:auth-delegator"  # may create tokenreviews
    (subject,) = binding["subjects"]
    assert (subject["kind"], subject["name"]) == ("ServiceAccount", central["serviceAccountName"])

    daemonset = kinds(DEPLOY / "daemonset.yaml")
    node_pod = pod_spec(daemonset["DaemonSet"])
    node = autobatch_container(node_pod)
    node_env = env_of(node)
    assert node_env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "AUTOBATCH_CENTRAL_API_TOKEN" not in node_env
    assert secret_files(node_pod, node) == {}  # no Secret at all: no other node's key
    account = f"{subject['namespace']}:{node_pod['serviceAccountName']}"
    assert service_accounts_of(settings.kubernetes_service_accounts) == {account}
    assert daemonset["ServiceAccount"]["metadata"]["name"] == node_pod["serviceAccountName"]
    assert node_pod["automountServiceAccountToken"] is False
    mount, _, file_name = node_env["AUTOBATCH_CENTRAL_API_TOKEN_FILE"].rpartition("/")
    (volume_name,) = [m["name"] for m in node["volumeMounts"] if m["mountPath"] == mount]
    (volume,) = [v for v in node_pod["volumes"] if v["name"] == volume_name]
    (source,) = volume["projected"]["sources"]
    projected = source["serviceAccountToken"]
    assert projected["path"] == file_name
    assert projected["audience"] == settings.kubernetes_audience
    assert projected["expirationSeconds"] <= 3600

    init = env_of(plan_init_container(kinds(DEPLOY / "training-job.yaml")["Job"]))
    assert init["AUTOBATCH_API_TOKEN"] == {
        "secretKeyRef": {"name": "autobatch-tokens", "key": "read"}
    }
    # The Secret as the command in central.yaml makes it, written with a trailing newline.
    secret = {"admin": "adm-1\n", "read": "rd-2\n"}
    files = tmp_path / "central"
    files.mkdir()
    for key, value in secret.items():
        (files / key).write_text(value)
    tokens = load_tokens(api_token=None, tokens_file=files)
    read_key = init["AUTOBATCH_API_TOKEN"]["secretKeyRef"]["key"]
    read_grant = tokens.identify(f"Bearer {secret[read_key]}")
    assert read_grant is not None and read_grant.role == "read"


def plan_init_container(job: dict[str, Any]) -> dict[str, Any]:
    (init,) = [c for c in pod_spec(job)["initContainers"] if c["name"] == "plan"]
    return init


def kubelet_expand(words: list[str], env: dict[str, str]) -> list[str]:
    """``$(NAME)`` in a container's command replaced from its env, as the kubelet does."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), word) for word in words]


def option(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


@contextmanager
def python_m_service(tmp_path: Path, token: str) -> Iterator[str]:
    """``python -m service`` on a free loopback port over a SQLite store; its base URL."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOBATCH_API_TOKEN": token}
    env.pop("AUTOBATCH_CENTRAL_URL", None)
    log = tmp_path / "service.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "service", "--port", str(port), "--log-level", "warning",
             "--store-path", str(tmp_path / "central.sqlite3")],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"python -m service did not start: {log.read_text()}")
                time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)


def autobatch_command(words: list[str]) -> list[str]:
    """The image's ``autobatch`` console script is this environment's."""
    assert words[0] == "autobatch"
    script = Path(sys.executable).with_name("autobatch")
    program = [str(script)] if script.exists() else [sys.executable, "-m", "autobatch"]
    return [*program, *words[1:]]


@pytest.mark.slow
def test_training_jobs_init_container_writes_the_plan_the_trainer_sources(tmp_path: Path) -> None:
    job = kinds(DEPLOY / "training-job.yaml")["Job"]
    init = plan_init_container(job)
    (trainer,) = pod_spec(job)["containers"]
    plan_file = env_of(init)["AUTOBATCH_PLAN_FILE"]
    # The trainer sources the file the init container writes, on the volume both mount.
    assert f". {plan_file}" in trainer["args"][0]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert plan_file.startswith(mounts["plan"] + "/")
    assert {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]} == mounts
    (volume,) = pod_spec(job)["volumes"]
    assert "emptyDir" in volume
    central = kinds(DEPLOY / "central.yaml")["Service"]
    assert env_of(init)["AUTOBATCH_CENTRAL_URL"] == (
        f"http://{central['metadata']['name']}:{central['spec']['ports'][0]['port']}"
    )
    words = init["command"]
    fingerprint, card = option(words, "--model-fingerprint"), option(words, "--card")
    token = "deploy-test-token"
    with python_m_service(tmp_path, token) as url:
        # A node publishes what it measured there (bf16, as the Job asks): 36 fits at 40 GiB.
        profile = make_profile(
            model_fingerprint=fingerprint,
            device_name=card,
            node_name="gpu-node-7",
            conditions=Conditions(device_type="cuda", amp_dtype="bfloat16"),
        )
        profile_id = publish_profile(url, profile, token=token)
        env = {
            "AUTOBATCH_CENTRAL_URL": url,  # the Service's address, here
            "AUTOBATCH_PLAN_FILE": str(tmp_path / "plan" / "plan.env"),  # the emptyDir, here
        }
        (tmp_path / "plan").mkdir()
        command = autobatch_command(kubelet_expand(words, env))
        done = subprocess.run(
            command,
            env={**os.environ, "AUTOBATCH_API_TOKEN": token},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        # The trainer's shell sources it.
        sourced = subprocess.run(
            ["sh", "-c", f". {env['AUTOBATCH_PLAN_FILE']} && env"],
            env={},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        variables = dict(
            line.split("=", 1) for line in sourced.splitlines() if line.startswith("AUTOBATCH_")
        )
        # Effective batch 1024 on 8 ranks: 128 per rank, micro-batches of at most 36 -> 4 x 32.
        assert variables == {
            "AUTOBATCH_MICRO_BATCH_SIZE": "32",
            "AUTOBATCH_GRADIENT_ACCUMULATION_STEPS": "4",
            "AUTOBATCH_EFFECTIVE_BATCH_SIZE": "1024",
            "AUTOBATCH_WORLD_SIZE": "8",
            "AUTOBATCH_RECOMMENDED_MICRO_BATCH_SIZE": "36",  # the profile's 40 less its margin
            "AUTOBATCH_MEASURED_MAX_MICRO_BATCH_SIZE": "40",
            "AUTOBATCH_MAX_MICRO_BATCH_SIZE": "36",  # the older name of the recommended size
            "AUTOBATCH_MICRO_BATCH_SIZES": "32,32,32,32",
            "AUTOBATCH_PLAN_SOURCE": "cached",  # as the JSON plan's source says
            "AUTOBATCH_PROFILE_MATCH": "measured",
            "AUTOBATCH_PREDICTED_PEAK_MEMORY_BYTES": str(20 * 2**30),
            "AUTOBATCH_PROFILE_ID": profile_id,
            "AUTOBATCH_PLAN_CARD": card,
            "AUTOBATCH_PROFILE_NODE": "gpu-node-7",
            "AUTOBATCH_PROFILE_CARD": card,
            "AUTOBATCH_ACTIVATION_CHECKPOINTING": "none",
        }

        # The Slurm TaskProlog asks the same service the same way, and prints Slurm's lines.
        prolog = subprocess.run(
            ["sh", str(DEPLOY / "slurm" / "prolog.sh")],
            env={
                "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                "PYTHONPATH": str(ROOT),  # this checkout's autobatch, as the image has it
                "AUTOBATCH_CENTRAL_URL": url,
                "AUTOBATCH_API_TOKEN": token,
                "AUTOBATCH_MODEL_FINGERPRINT": fingerprint,
                "AUTOBATCH_EFFECTIVE_BATCH_SIZE": "256",
                "AUTOBATCH_CARD": card,
                "AUTOBATCH_PLAN_DIR": str(tmp_path),
                "SLURM_JOB_ID": "4242",
                "SLURM_NTASKS": "4",
                "SLURMD_NODENAME": "gpu-node-9",
            },
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert prolog.returncode == 0, prolog.stderr
        lines = prolog.stdout.splitlines()
        assert "export AUTOBATCH_MICRO_BATCH_SIZE=32" in lines  # 256 / 4 = 64 = 2 x 32
        assert "export AUTOBATCH_GRADIENT_ACCUMULATION_STEPS=2" in lines
        assert f"export AUTOBATCH_PLAN_CARD={card}" in lines  # unquoted, spaces and all
        assert f"export AUTOBATCH_PLAN_FILE={tmp_path}/plan-4242.env" in lines

    # The service gone: the init container fails (the pod does not start training blind) and
    # the prolog lets the task start without a plan.
    done = subprocess.run(command, env=dict(os.environ), capture_output=True, text=True)
    assert done.returncode == 1
    assert "could not connect to " in done.stderr
