"""Trainer v2 and Volcano manifests, validated against the custom resources' own schemas.

Every rendered TrainJob, ClusterTrainingRuntime, TrainingRuntime, Volcano Job and PodGroup is
validated with jsonschema against its CRD's ``openAPIV3Schema`` from
``../shared/fixtures/k8s-crds/`` (offline; no API server can run here), made strict as the API
server's strict field validation is: an object with ``properties`` and neither
``additionalProperties`` nor ``x-kubernetes-preserve-unknown-fields`` refuses an unknown field.
Every pod template is also validated as a core/v1 PodTemplate by kubernetes-validate, and every
pod's ``TF_CONFIG``, expanded as Kubernetes expands ``$(VAR)`` with the index the pod gets from the
downward API, is resolved by psflow and compared with the cluster spec psflow laid out.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from psflow.cluster import TaskSpec, resolve
from psflow.deploy import JobConfig, plan, render

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT.parent / "shared" / "fixtures" / "k8s-crds"
K8S_VERSION = "1.30.0"

BASE: dict[str, Any] = {"name": "mnist", "image": "psflow:0.1.0", "script": "train.py"}

JOBS: dict[str, dict[str, Any]] = {
    "minimal": {},
    "one-worker": {"ps": 1, "workers": 1},
    "full": {
        "ps": 3,
        "workers": 4,
        "chief": True,
        "evaluators": 1,
        "gpus": 1,
        "cpu": "2",
        "memory": "4Gi",
        "cpu_limit": "4",
        "memory_limit": "8Gi",
        "keys_secret": "mnist-keys",
        "logdir_claim": "mnist-logs",
        "data_claim": "criteo",
        "namespace": "ml",
        "tensorboard": True,
        "pod_monitor": True,
        "node_selector": {"node.kubernetes.io/instance-type": "m7i.4xlarge"},
        "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"},
            {"key": "spot", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
        ],
        "priority_class": "training-high",
        "service_account": "mnist-trainer",
        "queue": "team-ads",
        "image_pull_policy": "IfNotPresent",
        "image_pull_secrets": ["regcred"],
        "mode": "sync",
        "args": ["--lr", "0.1", "it's"],
        "env": {"PSFLOW_TIMEOUT": "30"},
    },
    "gang-volcano": {"gang": "volcano", "ps": 2, "workers": 2, "queue": "q"},
    "gang-coscheduling": {"gang": "coscheduling", "chief": True},
    "namespaced-runtime": {"runtime_kind": "TrainingRuntime", "namespace": "team-a"},
    "no-metrics": {"metrics_port": 0, "evaluators": 2, "logdir_claim": "logs"},
}

CRD_FILES = {
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_trainjobs.yaml",
    ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime"): (
        "trainer.kubeflow.org_clustertrainingruntimes.yaml"
    ),
    (
        "trainer.kubeflow.org/v1alpha1",
        "TrainingRuntime",
    ): "trainer.kubeflow.org_trainingruntimes.yaml",
    ("batch.volcano.sh/v1alpha1", "Job"): "batch.volcano.sh_jobs.yaml",
    ("scheduling.volcano.sh/v1beta1", "PodGroup"): "scheduling.volcano.sh_podgroups.yaml",
}


def job(**kw: Any) -> JobConfig:
    return JobConfig(**{**BASE, **kw})


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.load_all(text, Loader=yaml.CSafeLoader) if d]


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever the API server would refuse them."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def validator(api_version: str, kind: str) -> jsonschema.Draft4Validator:
    path = CRDS / CRD_FILES[(api_version, kind)]
    crd = yaml.load(path.read_text(), Loader=yaml.CSafeLoader)
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    assert served["served"]
    schema = _strict(copy.deepcopy(served["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft4Validator(schema)


def validate_crd(doc: dict[str, Any]) -> None:
    """Validates ``doc`` against its CRD (failing on one not in the fixtures), its metadata as
    the API server checks it, and each pod template it holds as a core/v1 PodTemplate."""
    v = validator(doc["apiVersion"], doc["kind"])
    errors = sorted(v.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{doc['kind']} {'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in errors
    )
    meta = doc["metadata"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", meta["name"])
    if doc["kind"] == "TrainJob":
        # The CRD's own CEL rules on the name (jsonschema cannot run CEL): a DNS-1035 label.
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", meta["name"]) and len(meta["name"]) <= 63
    if doc["kind"] in ("ClusterTrainingRuntime", "TrainingRuntime"):
        # CEL: at most one framework policy; psflow's runtime is the plain one (none).
        assert not {"torch", "mpi", "jax", "xgboost", "flux"} & set(doc["spec"]["mlPolicy"])
    if doc["kind"] == "ClusterTrainingRuntime":
        assert "namespace" not in meta  # cluster-scoped
    for template in _pod_templates(doc):
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": template,
            },
            K8S_VERSION,
            strict=True,
        )


def _pod_templates(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc["kind"] in ("ClusterTrainingRuntime", "TrainingRuntime"):
        return [
            rj["template"]["spec"]["template"]
            for rj in doc["spec"]["template"]["spec"]["replicatedJobs"]
        ]
    if doc["kind"] == "Job" and doc["apiVersion"].startswith("batch.volcano.sh"):
        return [t["template"] for t in doc["spec"]["tasks"]]
    return []


def validate_any(doc: dict[str, Any]) -> None:
    if (doc["apiVersion"], doc["kind"]) in CRD_FILES:
        validate_crd(doc)
    elif doc["apiVersion"] == "monitoring.coreos.com/v1":
        assert doc["kind"] == "PodMonitor"
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def expand(value: str, defined: dict[str, str]) -> str:
    """``value`` as the kubelet expands it: ``$(NAME)`` of a variable defined above it,
    ``$$`` an escaped ``$``, anything else unchanged."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return defined.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def pod_env(container: dict[str, Any], fields: dict[str, str]) -> dict[str, str]:
    """The environment the container sees, with ``fields`` (a field path to its value) standing
    in for the downward API."""
    out: dict[str, str] = {}
    for var in container["env"]:
        if "valueFrom" in var:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"{var['name']} reads {path}, which this pod does not carry"
            out[var["name"]] = fields[path]
        else:
            out[var["name"]] = expand(var["value"], out)
    return out


@pytest.mark.parametrize("target", ["trainer", "volcano"])
@pytest.mark.parametrize("name", list(JOBS))
def test_every_object_validates_against_its_crd(target: str, name: str) -> None:
    config = job(**JOBS[name])
    if target == "volcano" and config.gang == "coscheduling":
        with pytest.raises(ValueError, match="gang coscheduling is for target trainer"):
            render(config, target)
        return
    objects = docs(render(config, target).text)
    kinds = [d["kind"] for d in objects]
    if target == "trainer":
        assert kinds[:2] == [config.runtime_kind, "TrainJob"]
    else:
        assert kinds[0] == "Job"
    for doc in objects:
        validate_any(doc)


def test_the_validator_catches_what_the_api_server_refuses() -> None:
    (runtime, trainjob) = docs(render(job(), "trainer").text)
    bad = copy.deepcopy(trainjob)
    bad["spec"]["trainer"]["numNodez"] = 2
    with pytest.raises(AssertionError, match="numNodez"):
        validate_crd(bad)
    bad = copy.deepcopy(trainjob)
    del bad["spec"]["runtimeRef"]
    with pytest.raises(AssertionError, match="runtimeRef"):
        validate_crd(bad)
    bad = copy.deepcopy(runtime)
    bad["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"
    ][0]["imagePullPolicy"] = 3
    with pytest.raises(AssertionError, match="imagePullPolicy"):
        validate_crd(bad)
    (vjob,) = docs(render(job(), "volcano").text)
    bad = copy.deepcopy(vjob)
    bad["spec"]["tasks"][0]["policies"][0]["events"] = ["PodCrashed"]
    with pytest.raises(AssertionError, match="PodCrashed"):
        validate_crd(bad)


def _trainer_pods(objects: list[dict[str, Any]]) -> list[tuple[str, str, int, dict[str, Any]]]:
    """(host, replicated job, index, container) of every pod JobSet would make for the TrainJob,
    with the TrainJob's own overrides of the trainer step applied as Trainer v2 does."""
    runtime, trainjob = objects[0], objects[1]
    assert trainjob["spec"]["runtimeRef"]["name"] == runtime["metadata"]["name"]
    assert trainjob["spec"]["runtimeRef"]["kind"] == runtime["kind"]
    if runtime["kind"] == "TrainingRuntime":  # found in the TrainJob's own namespace
        assert runtime["metadata"].get("namespace") == trainjob["metadata"].get("namespace")
    jobset = trainjob["metadata"]["name"]  # Trainer names the JobSet as the TrainJob
    spec = runtime["spec"]["template"]["spec"]
    assert spec["network"]["enableDNSHostnames"] is True
    pods = []
    for rj in spec["replicatedJobs"]:
        assert rj.get("replicas", 1) == 1
        jspec = rj["template"]["spec"]
        assert jspec["completionMode"] == "Indexed"
        n = jspec["parallelism"]
        assert jspec["completions"] == n
        pod_spec = jspec["template"]["spec"]
        assert pod_spec["restartPolicy"] == "OnFailure"
        (container,) = pod_spec["containers"]
        trainer_step = (
            rj["template"]["metadata"]["labels"].get("trainer.kubeflow.org/trainjob-ancestor-step")
            == "trainer"
        )
        if trainer_step:
            assert container["name"] == "node"
            t = trainjob["spec"]["trainer"]
            assert t["numNodes"] == n == runtime["spec"]["mlPolicy"]["numNodes"]
            assert t["image"] == container["image"] and t["args"] == container["args"]
        for k in range(n):
            # JobSet: Job <set>-<rj>-0, its Indexed pods' host names <job>-<k>, subdomain <set>.
            pods.append((f"{jobset}-{rj['name']}-0-{k}.{jobset}", rj["name"], k, container))
    return pods


def _volcano_pods(vjob: dict[str, Any]) -> list[tuple[str, str, int, dict[str, Any]]]:
    assert "svc" in vjob["spec"]["plugins"]
    name = vjob["metadata"]["name"]
    pods = []
    for task in vjob["spec"]["tasks"]:
        assert task["template"]["spec"]["restartPolicy"] == "OnFailure"
        (container,) = task["template"]["spec"]["containers"]
        for k in range(task["replicas"]):
            # The svc plugin: pod <job>-<task>-<index>, host name = pod name, subdomain <job>.
            pods.append((f"{name}-{task['name']}-{k}.{name}", task["name"], k, container))
    return pods


INDEX_FIELD = {
    "trainer": "metadata.annotations['batch.kubernetes.io/job-completion-index']",
    "volcano": "metadata.annotations['volcano.sh/task-index']",
}


@pytest.mark.parametrize("target", ["trainer", "volcano"])
@pytest.mark.parametrize(
    "name", ["minimal", "full", "gang-volcano", "no-metrics", "namespaced-runtime"]
)
def test_every_pods_tf_config_agrees_with_psflows_cluster_spec(target: str, name: str) -> None:
    config = job(**JOBS[name])
    laid_out = plan(config, target)
    objects = docs(render(config, target).text)
    pods = _trainer_pods(objects) if target == "trainer" else _volcano_pods(objects[0])
    expected = {(t.job, t.index) for t in laid_out.tasks}
    seen = set()
    job_of = {"node": "worker"}
    for host, group, k, container in pods:
        env = pod_env(container, {INDEX_FIELD[target]: str(k)})
        assert "$(" not in env["TF_CONFIG"]
        ctx, _ = resolve([], environ={"TF_CONFIG": env["TF_CONFIG"]})
        task = TaskSpec(job=job_of.get(group, group), index=k)
        assert ctx.task == task
        assert ctx.cluster.as_dict() == laid_out.cluster.as_dict()
        if task.job != "evaluator":
            # The address the others dial is the pod's own stable host name.
            assert ctx.cluster.address(task) == f"{host}:{config.port}"
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["psflow"] == config.port
        # The same TF_CONFIG the non-templated plan gives that task.
        (same,) = [t for t in laid_out.tasks if t.spec == task]
        assert json.loads(env["TF_CONFIG"]) == json.loads(same.tf_config)
        seen.add((task.job, task.index))
    assert seen == expected


def test_volcano_gang_is_every_ps_and_the_chief() -> None:
    for kw, gang in (({"ps": 3, "workers": 4}, 4), ({"ps": 2, "chief": True}, 3)):
        (vjob,) = docs(render(job(**kw), "volcano").text)
        spec = vjob["spec"]
        assert spec["schedulerName"] == "volcano"
        assert spec["minAvailable"] == gang
        per_task = {t["name"]: t["minAvailable"] for t in spec["tasks"]}
        assert sum(per_task.values()) == gang
        assert per_task["ps"] == kw["ps"]
        chief_task = "chief" if kw.get("chief") else "worker"
        assert per_task[chief_task] == 1
        for t in spec["tasks"]:
            assert {"events": ["PodFailed", "PodEvicted"], "action": "RestartPod"} in t["policies"]
            done = {"event": "TaskCompleted", "action": "CompleteJob"} in t["policies"]
            assert done == (t["name"] == chief_task)


def test_trainer_runtime_asks_for_gang_scheduling() -> None:
    (runtime, _) = docs(render(job(gang="volcano"), "trainer").text)
    assert runtime["spec"]["podGroupPolicy"] == {"volcano": {}}
    (runtime, _) = docs(render(job(gang="coscheduling"), "trainer").text)
    assert "coscheduling" in runtime["spec"]["podGroupPolicy"]
    (runtime, _) = docs(render(job(), "trainer").text)
    assert "podGroupPolicy" not in runtime["spec"]
    # Success when the trainers are done (the ps then end with the set), failure once a job
    # has used its restarts in place.
    spec = runtime["spec"]["template"]["spec"]
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["node"]}
    assert spec["failurePolicy"] == {"maxRestarts": 0}


def test_kubernetes_gang_is_a_volcano_podgroup() -> None:
    config = job(gang="volcano", ps=2, workers=3, queue="research")
    objects = docs(render(config, "kubernetes").text)
    (group,) = [d for d in objects if d["kind"] == "PodGroup"]
    validate_crd(group)
    assert group["spec"]["minMember"] == 5 and group["spec"]["queue"] == "research"
    jobs = [d for d in objects if d["kind"] == "Job"]
    assert len(jobs) == 5
    for j in jobs:
        pod = j["spec"]["template"]
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "mnist"
        # Volcano's queue, not Kueue's: the two would each hold the job for the other.
        assert "kueue.x-k8s.io/queue-name" not in j["metadata"]["labels"]
