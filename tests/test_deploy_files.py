"""docker/: the Dockerfiles hold the README's install and run aserve as PID 1 in exec
form; the Kubernetes manifests validate against the Kubernetes schemas (offline, with
kubernetes-validate's bundled ones) and carry the probes and drain settings the docs
promise."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
K8S_VERSION = "1.37.0"


def readme_commands() -> tuple[str, str]:
    """(install, run) as the README's quick start writes them."""
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    install = next(line for line in lines if "pip install" in line)
    run = next(line for line in lines if " run" in line and "aserve" in line)
    return install, run


def instructions(name: str) -> list[dict]:
    with (DOCKER / name).open("rb") as f:
        steps = DockerfileParser(fileobj=f).structure
    return [s for s in steps if s["instruction"] != "COMMENT"]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfile_installs_as_the_readme_and_runs_aserve_as_pid_1(name):
    steps = instructions(name)
    kinds = [s["instruction"] for s in steps]
    assert kinds[0] == "FROM"
    install, run = readme_commands()
    assert any(s["instruction"] == "RUN" and s["value"].strip() == install for s in steps), install
    # Exec form (a JSON array): no shell between the container runtime and the supervisor.
    entry = next(s for s in steps if s["instruction"] == "ENTRYPOINT")["value"]
    argv = json.loads(entry)
    assert argv[0].endswith("/.venv/bin/aserve") and argv[1] == run.split()[-1] == "run"
    assert "--host" in argv and argv[argv.index("--host") + 1] == "0.0.0.0"
    health = next(s for s in steps if s["instruction"] == "HEALTHCHECK")["value"]
    assert "/health" in health and "CMD [" in health  # exec form too
    users = [s["value"].strip() for s in steps if s["instruction"] == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert any(s["instruction"] == "VOLUME" and "/models" in s["value"] for s in steps)


def _manifests() -> list[dict]:
    """The single-pod manifests (lws.yaml, one engine across pods, has its own tests)."""
    return [doc for path in sorted((DOCKER / "k8s").glob("*.yaml")) if path.name != "lws.yaml"
            for doc in yaml.safe_load_all(path.read_text())]


def _lws() -> tuple[dict, dict]:
    lws, service = yaml.safe_load_all((DOCKER / "k8s" / "lws.yaml").read_text())
    return lws, service


def test_the_leader_worker_set_validates_against_the_kubernetes_schemas():
    """LeaderWorkerSet is a custom resource the bundled schemas do not have: its Service
    and both of its pod templates (as pods) are validated against the Kubernetes schemas,
    and its own fields are checked here."""
    import kubernetes_validate

    lws, service = _lws()
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    kubernetes_validate.validate(service, K8S_VERSION, strict=True)
    template = lws["spec"]["leaderWorkerTemplate"]
    assert set(lws["spec"]) <= {"replicas", "leaderWorkerTemplate", "startupPolicy", "rolloutStrategy",
                                "networkConfig"}
    assert set(template) <= {"size", "restartPolicy", "leaderTemplate", "workerTemplate", "subGroupPolicy"}
    assert lws["spec"]["startupPolicy"] in ("LeaderCreated", "LeaderReady")
    for role in ("leaderTemplate", "workerTemplate"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **template[role]["metadata"]},
               "spec": template[role]["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def _args(container: dict, group_size: int, index: int) -> list[str]:
    """The container's args as LWS's environment expands them."""
    values = {"$(LWS_GROUP_SIZE)": str(group_size), "$(LWS_WORKER_INDEX)": str(index),
              "$(LWS_LEADER_ADDRESS)": "aserve-0.aserve.default"}
    return [values.get(a, a) for a in container["args"]]


def test_the_leader_worker_set_runs_one_engine_over_its_group():
    from aserve.cli import build_parser
    from aserve.engine.args import from_cli

    lws, service = _lws()
    template = lws["spec"]["leaderWorkerTemplate"]
    size = template["size"]
    assert size >= 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    parsed = {}
    for role, container, index in (("leader", leader, 0), ("worker", worker, 1)):
        args = build_parser().parse_args(["run", *_args(container, size, index)])
        engine = from_cli(args)
        parsed[role] = (args, engine)
        assert (engine.nnodes, engine.node_rank, engine.master_addr) == (size, index, "aserve-0.aserve.default")
        assert args.headless == (role == "worker")
        # The secret from a Kubernetes Secret, as the environment variable aserve reads.
        env = {e["name"]: e for e in container["env"]}
        assert env["ASERVE_DP_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "aserve-node-secret"
        spec = template[f"{role}Template"]["spec"]
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])
    # Same engine on both sides; the leader serves HTTP with probes, the Service finds only it.
    assert parsed["leader"][1].pipeline_parallel_size == parsed["worker"][1].pipeline_parallel_size
    assert parsed["leader"][1].master_port == parsed["worker"][1].master_port
    ports = {p["containerPort"] for p in leader["ports"]}
    assert {8000, parsed["leader"][1].master_port + 1, parsed["leader"][1].master_port + 2} <= ports
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert leader["livenessProbe"]["httpGet"]["path"] == "/health"
    assert service["spec"]["selector"] == template["leaderTemplate"]["metadata"]["labels"]
    assert service["spec"]["selector"] != template["workerTemplate"]["metadata"]["labels"]


def test_manifests_validate_against_the_kubernetes_schemas():
    import kubernetes_validate

    docs = _manifests()
    assert {d["kind"] for d in docs} == {"Deployment", "Service"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    broken = json.loads(json.dumps(docs[0]))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSeconds"] = "often"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_deployment_probes_drain_and_shared_memory():
    deployment = next(d for d in _manifests() if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    args = container["args"]
    shutdown = float(args[args.index("--shutdown-timeout") + 1])
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > shutdown + pre_stop
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert any(m["name"] == "dshm" and m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    service = next(d for d in _manifests() if d["kind"] == "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
