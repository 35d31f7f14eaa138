"""The Helm chart (infra/helm/rlstream), checked offline: ``helm lint``, ``helm template`` with the
default, Strimzi and multi-node values, every rendered object against the Kubernetes schemas
(kubernetes-validate) or, for KEDA's CRDs, a schema written here, and the rendered job config and
Kafka environment fed to the real ``rlstream config show``."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from tests.infra_tools import REPO, SETUP, rlstream, tool

HELM = tool("helm")
CHART = REPO / "infra/helm/rlstream"
STRIMZI = CHART / "values-strimzi.yaml"
KUBE = "1.33.0"
VARIANTS = {
    "default": [],
    "strimzi": ["-f", str(STRIMZI)],
    "multinode": ["--set", "trainer.nodes=3", "--set", "trainer.gpusPerNode=8", "--set", "autoscaling.enabled=false"],
}
pytestmark = pytest.mark.skipif(HELM is None, reason=f"helm not built (run {SETUP}: go install helm v3.22.0)")

_STR = {"type": "string", "minLength": 1}
SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "properties": {"name": _STR}},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"const": "kafka"},
                            "metadata": {  # KEDA takes trigger metadata as strings only
                                "type": "object",
                                "required": ["bootstrapServers", "consumerGroup", "topic", "lagThreshold"],
                                "additionalProperties": _STR,
                                "properties": {
                                    "lagThreshold": {"type": "string", "pattern": "^[0-9]+$"},
                                    "sasl": {"enum": ["plaintext", "scram_sha256", "scram_sha512"]},
                                    "tls": {"enum": ["enable", "disable"]},
                                },
                            },
                            "authenticationRef": {"type": "object", "required": ["name"]},
                        },
                    },
                },
            },
        },
    },
}
TRIGGER_AUTH = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "spec": {
            "type": "object",
            "required": ["secretTargetRef"],
            "properties": {
                "secretTargetRef": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["parameter", "name", "key"],
                        "additionalProperties": False,
                        "properties": {
                            "parameter": {"enum": ["sasl", "username", "password", "tls", "ca", "cert", "key"]},
                            "name": _STR,
                            "key": _STR,
                        },
                    },
                }
            },
        },
    },
}


def helm(*args: str) -> str:
    proc = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"helm {' '.join(args)}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def render(variant: str) -> list[dict]:
    out = helm("template", "rl", str(CHART), "--namespace", "rl", "--kube-version", KUBE, *VARIANTS[variant])
    return [o for o in yaml.safe_load_all(out) if o]


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def test_helm_lint():
    for extra in ([], ["-f", str(STRIMZI)]):
        out = helm("lint", "--strict", "--kube-version", KUBE, str(CHART), *extra)
        assert "0 chart(s) failed" in out


def test_helm_template_and_lint_without_a_cluster_or_kube_version():
    """As a user runs them offline (docs/how-to/deploy.md): helm's own default Kubernetes version must
    satisfy the chart's kubeVersion. A helm `go install`ed without helm's release ldflags defaults to
    1.20 and refuses the chart; scripts/setup-infra-tools.sh links it like a release build."""
    meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    proc = subprocess.run([HELM, "template", "rl", str(CHART)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"{proc.stderr.strip()} (chart kubeVersion {meta['kubeVersion']}; rebuild helm: {SETUP})"
    )
    kinds = {o["kind"] for o in yaml.safe_load_all(proc.stdout) if o}
    assert {"Deployment", "StatefulSet", "Job", "ConfigMap"} <= kinds
    assert "0 chart(s) failed" in helm("lint", "--strict", str(CHART))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_objects_are_valid(variant):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason=f"run {SETUP}")
    jsonschema = pytest.importorskip("jsonschema")
    objs = render(variant)
    for o in objs:
        if o["apiVersion"].startswith("keda.sh/"):
            jsonschema.validate(o, {"ScaledObject": SCALED_OBJECT, "TriggerAuthentication": TRIGGER_AUTH}[o["kind"]])
        else:
            kubernetes_validate.validate(o, KUBE, strict=True)
    deployments, jobs = by_kind(objs, "Deployment"), by_kind(objs, "Job")
    assert set(deployments) == {"rl-rlstream-rollout", "rl-rlstream-reward"}
    assert set(jobs) == {"rl-rlstream-topics", "rl-rlstream-feed"}
    pods = [
        o["spec"]["template"] for o in [*deployments.values(), *jobs.values(), *by_kind(objs, "StatefulSet").values()]
    ]
    for pod in pods:  # every pod mounts the job config and passes it with --config
        (c,) = pod["spec"]["containers"]
        assert {"name": "config", "mountPath": "/etc/rlstream", "readOnly": True} in c["volumeMounts"]
        assert "--config=/etc/rlstream/job.toml" in " ".join(c["args"]).replace("--config /", "--config=/")
    for name, d in deployments.items():
        ann, (c,) = d["spec"]["template"]["metadata"]["annotations"], d["spec"]["template"]["spec"]["containers"]
        assert (
            ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == c["ports"][0]["containerPort"]
        )
        role = name.rsplit("-", 1)[1]
        assert f"{role}.prometheus_port={ann['prometheus.io/port']}" in c["args"]
    scaled = by_kind(objs, "ScaledObject")
    if variant == "multinode":
        assert not scaled and all("replicas" in d["spec"] for d in deployments.values())
        return
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled.values()} == set(deployments)
    assert all("replicas" not in d["spec"] for d in deployments.values())  # KEDA owns the replica count
    lag = {
        t["metadata"]["consumerGroup"]: t["metadata"]["topic"] for s in scaled.values() for t in s["spec"]["triggers"]
    }
    assert lag == {"rlstream-rollout": "rl.prompts", "rlstream-reward": "rl.rollouts"}


def test_trainer_statefulset_runs_torchrun_across_nodes():
    (sts,) = by_kind(render("multinode"), "StatefulSet").values()
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert sts["spec"]["replicas"] == 3 and c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert c["command"] == ["tini", "--", "torchrun"]
    args = c["args"]
    assert {"--nnodes=3", "--nproc-per-node=8", "--node-rank=$(NODE_RANK)"} <= set(args)
    assert args[args.index("/opt/venv/bin/rlstream") + 1] == "train"
    master = next(a for a in args if a.startswith("--master-addr="))
    assert master == f"--master-addr={sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
    (single,) = by_kind(render("default"), "StatefulSet").values()
    assert "command" not in single["spec"]["template"]["spec"]["containers"][0]  # one rank: plain `rlstream train`


def test_strimzi_values_reach_rlstream_and_keda(tmp_path):
    objs = render("strimzi")
    (cm,) = by_kind(objs, "ConfigMap").values()
    for name, text in cm["data"].items():
        (tmp_path / name).write_text(text)
    reward = by_kind(objs, "Deployment")["rl-rlstream-reward"]["spec"]["template"]["spec"]
    (c,) = reward["containers"]
    env: dict[str, str] = {}
    for e in c["env"]:  # as the kubelet would: secrets, the downward API, then $(VAR) references
        if "valueFrom" in e:
            env[e["name"]] = "s3cretPW" if "secretKeyRef" in e["valueFrom"] else "rl-rlstream-reward-7d9f-abcde"
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
    args = [a.replace("/etc/rlstream", str(tmp_path)) for a in c["args"][1:]]
    proc = rlstream("config", "show", "--json", *args, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = json.loads(proc.stdout)
    assert cfg["kafka"]["bootstrap_servers"] == "rl-kafka-kafka-bootstrap:9093"
    assert cfg["kafka"]["common"] == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "rlstream",
        "sasl.password": "s3cretPW",
        "ssl.ca.location": "/etc/rlstream/kafka-ca/ca.crt",
    }
    assert cfg["topics"]["prefix"] == "rl." and cfg["topics"]["replication_factor"] == 3
    assert cfg["reward"]["group_id"] == "rlstream-reward" and cfg["reward"]["prometheus_port"] == 9110
    assert cfg["reward"]["worker_id"] == "rl-rlstream-reward-7d9f-abcde"
    ca_mount = next(m for m in c["volumeMounts"] if m["name"] == "kafka-ca")
    ca_vol = next(v for v in reward["volumes"] if v["name"] == "kafka-ca")
    assert (
        ca_mount["mountPath"] == "/etc/rlstream/kafka-ca"
        and ca_vol["secret"]["secretName"] == "rl-kafka-cluster-ca-cert"
    )
    (auth,) = by_kind(objs, "TriggerAuthentication").values()
    refs = {r["parameter"]: (r["name"], r["key"]) for r in auth["spec"]["secretTargetRef"]}
    assert refs == {
        "username": ("rl-rlstream-kafka-user", "username"),
        "password": ("rlstream", "password"),
        "ca": ("rl-kafka-cluster-ca-cert", "ca.crt"),
    }
    assert by_kind(objs, "Secret")["rl-rlstream-kafka-user"]["stringData"]["username"] == "rlstream"
    for s in by_kind(objs, "ScaledObject").values():
        (t,) = s["spec"]["triggers"]
        assert t["metadata"]["sasl"] == "scram_sha512" and t["metadata"]["tls"] == "enable"
        assert t["authenticationRef"]["name"] == auth["metadata"]["name"]


def test_strimzi_example_matches_the_values():
    values = yaml.safe_load(STRIMZI.read_text())
    docs = {d["kind"]: d for d in yaml.safe_load_all((CHART / "examples/strimzi.yaml").read_text())}
    assert {"Kafka", "KafkaNodePool", "KafkaUser"} <= set(docs)
    assert all(d["apiVersion"] == "kafka.strimzi.io/v1beta2" for d in docs.values())
    cluster, user = docs["Kafka"]["metadata"]["name"], docs["KafkaUser"]
    assert user["metadata"]["labels"]["strimzi.io/cluster"] == cluster
    kafka = values["kafka"]
    assert kafka["sasl"]["username"] == kafka["sasl"]["passwordSecret"]["name"] == user["metadata"]["name"]
    assert kafka["tls"]["caSecret"]["name"] == f"{cluster}-cluster-ca-cert"
    host, port = kafka["bootstrapServers"].split(":")
    (listener,) = [lst for lst in docs["Kafka"]["spec"]["kafka"]["listeners"] if lst["port"] == int(port)]
    assert host == f"{cluster}-kafka-bootstrap" and listener["tls"] is True
    assert listener["authentication"]["type"] == user["spec"]["authentication"]["type"] == "scram-sha-512"
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    acls = {(a["resource"]["type"], a["resource"].get("name")) for a in user["spec"]["authorization"]["acls"]}
    assert ("topic", defaults["topicPrefix"]) in acls
    assert all(g.startswith("rlstream-") for g in defaults["groups"].values()) and ("group", "rlstream-") in acls
