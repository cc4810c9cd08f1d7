"""deploy/kubernetes/: every setup's rendered manifests are valid against a current Kubernetes version's
schemas (kubernetes-validate, strict: an unknown field fails) and the custom resources against their own
projects' CRD schemas (deploy/kubernetes/schemas/), the pods' commands are real flags of `pagedserve serve`
and of vllm-router, and the pieces agree with each other (probes, Secrets, ports, GPUs, ranks). Nothing runs
in a cluster here: docs/kubernetes.md says what was and was not run."""

from __future__ import annotations

import copy
import json
import re
import shutil
import stat
from dataclasses import fields
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from vllm_router.launch_router import parse_router_args

from pagedserve import FOLDERS
from pagedserve.cli import NOT_FLAGS, PROCESSES, build_parser
from pagedserve.common.security import ClusterKeyError, load_cluster_key
from pagedserve.multinode import NodeConfig, node_settings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
SCHEMAS = DEPLOY / "schemas"
SETUPS = ("single", "replicas", "multinode")
K8S_VERSION = kubernetes_validate.latest_version()  # the newest the installed package ships (1.37)
# What LWS gives each pod of a group of 2 (the leader is worker index 0)
LWS_ENV = {
    "LWS_GROUP_SIZE": "2",
    "LWS_LEADER_ADDRESS": "pagedserve-0.pagedserve.default",
    "LWS_WORKER_INDEX": "0",
}
KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources"}  # what render() understands: nothing else


def render(folder: Path) -> list[dict[str, Any]]:
    """The documents `kubectl apply -k folder` applies: our kustomizations only list resources (files, or
    folders with a kustomization of their own), so this is kustomize's output, in file order."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(kustomization) <= KUSTOMIZATION_KEYS, f"{folder}: render() would ignore {set(kustomization)}"
    docs: list[dict[str, Any]] = []
    for entry in kustomization["resources"]:
        path = (folder / entry).resolve()
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def crd_schema(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The vendored schema of a custom resource's group, kind and version; None for the core API."""
    group, _, version = doc["apiVersion"].rpartition("/")
    path = SCHEMAS / f"{group}_{doc['kind']}_{version}.json".lower()
    return json.loads(path.read_text()) if group and path.exists() else None


def strict(schema: Any) -> Any:
    """`schema` refusing properties it does not list, as kubernetes-validate's strict mode does (a CRD's
    schema leaves them to be pruned, silently: a misspelled field would pass)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {})
    if doc["kind"] == "LeaderWorkerSet":
        lwt = spec["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return [spec["template"]] if "template" in spec else []


def validate(doc: dict[str, Any]) -> None:
    """Raises when `doc` is not valid: core kinds by kubernetes-validate, custom ones by their CRD's schema,
    with LeaderWorkerSet's pod templates validated as core PodTemplateSpecs."""
    schema = crd_schema(doc)
    if schema is None:
        assert "/" not in doc["apiVersion"] or doc["apiVersion"].split("/")[0] in ("apps", "policy"), doc
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    jsonschema.Draft7Validator(strict(schema)).validate(doc)
    for template in pod_templates(doc):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(wrapped, K8S_VERSION, strict=True)


def containers(docs: list[dict[str, Any]], image: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod spec, container) of every container of `image`."""
    return [
        (t["spec"], c)
        for d in docs
        for t in pod_templates(d)
        for c in t["spec"].get("initContainers", []) + t["spec"]["containers"]
        if c["image"] == image
    ]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of a container's args."""
    return [re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], a) for a in args]


@pytest.fixture(scope="module", params=SETUPS)
def setup(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(DEPLOY / request.param)


def test_every_manifest_is_valid_against_its_schema(setup: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = setup
    kinds = {d["kind"] for d in docs}
    expected = {
        "single": {"Deployment", "Service", "ServiceMonitor"},
        "replicas": {"StatefulSet", "Service", "Deployment", "ServiceMonitor"},
        "multinode": {"LeaderWorkerSet", "Service", "ServiceMonitor"},
    }
    assert kinds == expected[name]
    for doc in docs:
        validate(doc)


def test_a_broken_manifest_fails_validation() -> None:
    """The validation above can fail: a misspelled field of a core kind, of a custom resource and of a pod
    template inside one, and a wrong type, are each refused."""
    single, multinode = render(DEPLOY / "single"), render(DEPLOY / "multinode")
    deployment = copy.deepcopy(next(d for d in single if d["kind"] == "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    lws = next(d for d in multinode if d["kind"] == "LeaderWorkerSet")
    misspelled_lws = copy.deepcopy(lws)
    misspelled_lws["spec"]["leaderWorkerTemplat"] = misspelled_lws["spec"].pop("leaderWorkerTemplate")
    bad_pod = copy.deepcopy(lws)
    bad_pod["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["args"] = "serve"
    monitor = copy.deepcopy(next(d for d in single if d["kind"] == "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["intreval"] = "15s"
    for doc in (deployment, misspelled_lws, bad_pod, monitor):
        with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
            validate(doc)


def test_the_server_commands_are_real_flags_of_pagedserve_serve(
    setup: tuple[str, list[dict[str, Any]]],
) -> None:
    """Parsed by pagedserve/cli.py's own parser and checked by the processes' configs, so a renamed or
    removed flag, or a value a process refuses, fails here."""
    name, docs = setup
    servers = [c for _, c in containers(docs, "pagedserve") if c.get("args")]
    assert servers
    for container in servers:
        for index in range(int(LWS_ENV["LWS_GROUP_SIZE"])):
            args = expand(container["args"], LWS_ENV | {"LWS_WORKER_INDEX": str(index)})
            assert args[0] == "serve"
            parsed = build_parser().parse_args(args)  # exits (status 2) on an unknown flag or a bad value
            for _, cls in PROCESSES:
                cls(
                    **{
                        f.name: v
                        for f in fields(cls)
                        if f.name not in NOT_FLAGS and (v := getattr(parsed, f.name)) is not None
                    }
                )
            node = NodeConfig(**{f.name: getattr(parsed, f.name) for f in fields(NodeConfig)})
            ranks = node.local_ranks(parsed.tensor_parallel_size)
            values, _ = node_settings(node, {"worker_address": parsed.worker_address})
            if name == "multinode":
                assert node.nnodes == 2 and node.node_rank == index
                # every host reaches the leader's scheduler by its name, which the leader binds as a wildcard
                assert values["worker_address"] == f"tcp://{LWS_ENV['LWS_LEADER_ADDRESS']}:5571"
                gpus = container["resources"]["limits"]["nvidia.com/gpu"]
                assert len(ranks) == gpus, "one rank per GPU of the pod"
            else:
                assert node.nnodes == 1 and len(ranks) == container["resources"]["limits"]["nvidia.com/gpu"]
            if name != "multinode":
                break


def test_the_router_is_pointed_at_every_replica_and_its_kv_events() -> None:
    docs = render(DEPLOY / "replicas")
    replicas = next(d for d in docs if d["kind"] == "StatefulSet")
    headless = next(d for d in docs if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None")
    [(_, router)] = containers(docs, "pagedserve-router")
    args = router["args"]
    parsed = parse_router_args(args)  # vllm-router's own parser: its flags and choices
    assert parsed.policy == "kv_aware"
    names = [f"{replicas['metadata']['name']}-{i}.{headless['metadata']['name']}" for i in range(2)]
    assert replicas["spec"]["replicas"] == len(names)
    assert replicas["spec"]["serviceName"] == headless["metadata"]["name"]
    assert parsed.worker_urls == [f"http://{n}:8000" for n in names]
    [(_, server)] = [(p, c) for p, c in containers(docs, "pagedserve") if c.get("args")]
    events = json.loads(flag(server["args"], "--kv-events-config"))
    assert events["enable_kv_cache_events"] and "topic" not in events  # the router's sources read topic ""
    pub, replay = (int(events[k].rsplit(":", 1)[1]) for k in ("endpoint", "replay_endpoint"))
    sources = [a for i, a in enumerate(args) if i and args[i - 1] == "--kv-event-source"]
    replays = [a for i, a in enumerate(args) if i and args[i - 1] == "--kv-event-replay-source"]
    assert sources == [f"http://{n}:8000=tcp://{n}:{pub}" for n in names]
    assert replays == [f"http://{n}:8000=tcp://{n}:{replay}" for n in names]
    ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    assert ports == {"http": 8000, "kv-events": pub, "kv-replay": replay}
    block_size = build_parser().parse_args(server["args"]).block_size
    assert int(flag(args, "--kv-event-block-size")) == block_size
    assert flag(args, "--kv-event-model") == server["args"][1]
    assert flag(args, "--health-check-endpoint") == "/health"


def test_probes_secrets_and_services_fit_the_server(setup: tuple[str, list[dict[str, Any]]]) -> None:
    """/health is 503 while the model loads: readiness waits on it, a startup probe keeps liveness off a
    loading pod; the cluster key reaches the server as a 0600 file copied from its Secret (and only the pods
    that talk to the scheduler hold it); the api keys are the Secret's file."""
    name, docs = setup
    for pod, container in containers(docs, "pagedserve"):
        if not container.get("args"):  # the init container: install -m 0600 SECRET_FILE KEY_FILE
            assert container["command"][:3] == ["install", "-m", "0600"]
            continue
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        if "startupProbe" not in container:  # a multi-node worker pod: no api, and no key (no scheduler)
            assert name == "multinode" and "initContainers" not in pod
            assert not any("secret" in v for v in volumes.values())
            assert not {"--api-key-file", "--cluster-key-file"} & set(container["args"])
            continue
        [init] = pod["initContainers"]
        source, target = init["command"][3:]
        init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
        key_file = flag(container["args"], "--cluster-key-file")
        assert target == key_file and Path(key_file).parent.as_posix() in mounts
        assert volumes[mounts[str(Path(key_file).parent)]]["emptyDir"]["medium"] == "Memory"
        assert source.startswith(init_mounts["cluster-key"] + "/")
        assert volumes["cluster-key"]["secret"]["secretName"] == "pagedserve-cluster-key"
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] == 1000
        if "--api-key-file" in container["args"]:
            api_keys = Path(flag(container["args"], "--api-key-file"))
            assert volumes[mounts[str(api_keys.parent)]]["secret"]["secretName"] == "pagedserve-api-keys"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
        startup = container["startupProbe"]
        assert startup["failureThreshold"] * startup["periodSeconds"] >= 1200  # a large model's download
        http = flag(container["args"], "--port")
        assert {"name": "http", "containerPort": int(http)} in container["ports"]
        assert flag(container["args"], "--host") == "0.0.0.0"
    services = [d for d in docs if d["kind"] == "Service"]
    assert any(s["metadata"]["labels"]["app.kubernetes.io/component"] == "server" for s in services)


def _secret_volume(tmp_path: Path, mode: int) -> Path:
    """A Secret's file as the kubelet lays it out: KEY -> ..data/KEY, ..data -> ..<timestamp>/ holding the
    file with the volume's mode (fsGroup adds group read, so defaultMode 0400 becomes 0440 there)."""
    volume = tmp_path / "secret"
    stamped = volume / "..2026_11_27_20_00_00.000000001"
    stamped.mkdir(parents=True)
    load_cluster_key(tmp_path / "made" / "cluster_key")
    shutil.copy(tmp_path / "made" / "cluster_key", stamped / "cluster_key")
    (stamped / "cluster_key").chmod(mode)
    (volume / "..data").symlink_to(stamped.name)
    (volume / "cluster_key").symlink_to("..data/cluster_key")
    return volume / "cluster_key"


def test_the_cluster_key_loader_on_a_secret_volume(tmp_path: Path) -> None:
    """Why the manifests copy the key: a Secret's file under fsGroup (0440) is refused as open to others;
    the copy the init container makes (0600) loads, as does the Secret's file itself at 0400 (a pod running
    as the file's owner, root, without fsGroup)."""
    refused = _secret_volume(tmp_path / "a", 0o440)
    with pytest.raises(ClusterKeyError, match="open to other users"):
        load_cluster_key(refused, create=False)
    copied = tmp_path / "run" / "cluster_key"
    copied.parent.mkdir()
    shutil.copy(refused, copied)
    copied.chmod(0o600)  # install -m 0600
    assert (
        load_cluster_key(copied, create=False).public
        == load_cluster_key(tmp_path / "a" / "made" / "cluster_key").public
    )
    owner_only = _secret_volume(tmp_path / "b", 0o400)
    assert stat.S_IMODE(owner_only.stat().st_mode) == 0o400
    assert len(load_cluster_key(owner_only, create=False).public) == 40


def test_the_dockerfile_installs_what_the_manifests_run() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = {src for line in text.splitlines() if line.startswith("COPY ") for src in line.split()[1:-1]}
    needed = {"pyproject.toml", "setup.py", "README.md", "LICENSE", "constraints.txt", "pagedserve"}
    assert needed | set(FOLDERS) <= copied
    assert 'ENTRYPOINT ["pagedserve"]' in text and "USER 1000" in text
    assert "pip install -c constraints.txt ." in text
    ignored = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().split()
    assert {f"!{name}" for name in needed | set(FOLDERS)} <= set(ignored)


def test_the_router_image_installs_the_router_ci_tests() -> None:
    pin = next(line.split()[0] for line in (ROOT / "requirements-dev.txt").read_text().splitlines()
               if line.startswith("vllm-router=="))  # fmt: skip
    text = (ROOT / "deploy" / "router.Dockerfile").read_text()
    assert f"pip install {pin}" in text and 'ENTRYPOINT ["vllm-router"]' in text
