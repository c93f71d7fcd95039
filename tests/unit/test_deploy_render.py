"""Rendered manifests: schema validation per target, and the TF_CONFIG round trip.

Kubernetes manifests are validated with kubernetes-validate in strict mode (unknown fields are
errors) against 1.30 and the newest schemas it ships. The TFJob CRD is not among those schemas:
its pod templates are validated as core/v1 PodTemplates, the rest against the TFJob v1 fields
below. Compose and Marathon have no offline schema here: their structure is checked field by
field, and compose also by `docker compose config` where that plugin is installed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from psflow.cluster import ClusterSpec, TaskSpec, resolve
from psflow.deploy import JobConfig, render

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())

BASE: dict[str, Any] = {"name": "mnist", "image": "psflow:0.1.0", "script": "train.py"}

# Every combination the issue asks for: chief, evaluator, GPUs, keys, TensorBoard on and off.
K8S_JOBS: dict[str, dict[str, Any]] = {
    "minimal": {},
    "no-ps": {"ps": 0, "workers": 1},
    "full": {
        "ps": 2,
        "workers": 3,
        "chief": True,
        "evaluators": 1,
        "gpus": 2,
        "cpu": "1500m",
        "memory": "4Gi",
        "keys_secret": "mnist-keys",
        "logdir_claim": "mnist-logs",
        "namespace": "ml",
        "tensorboard": True,
        "pod_monitor": True,
        "metrics_port": 9100,
        "port": 3000,
        "args": ["--lr", "0.1", "it's"],
        "env": {"PSFLOW_TIMEOUT": "30"},
    },
    "tensorboard-off": {
        "chief": True,
        "evaluators": 2,
        "gpus": 1,
        "keys_secret": "k",
        "logdir_claim": "logs",
        "tensorboard": False,
    },
    "command": {"script": None, "command": ["psflow", "launch", "--ps", "1"], "memory": "1G"},
    "no-metrics": {"metrics_port": 0},
}


def job(**kw: Any) -> JobConfig:
    return JobConfig(**{**BASE, **kw})


def docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def validate_k8s(doc: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        # SchemaNotFoundError (an unknown kind or apiVersion) fails the test as well.
        kubernetes_validate.validate(doc, version, strict=True)


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


# -- Kubernetes --------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(K8S_JOBS))
def test_kubernetes_manifests_validate_strictly(variant: str) -> None:
    config = job(**K8S_JOBS[variant])
    objects = docs(render(config, "kubernetes").text)
    monitors = [d for d in objects if d["kind"] == "PodMonitor"]
    assert len(monitors) == int(config.pod_monitor)
    for d in monitors:
        jsonschema.validate(d, POD_MONITOR_SCHEMA)  # kubernetes-validate has no CRD schemas
        assert d["metadata"].get("namespace") == config.namespace
    objects = [d for d in objects if d["kind"] != "PodMonitor"]
    kinds = [(d["apiVersion"], d["kind"]) for d in objects]
    assert set(kinds) <= {("v1", "Service"), ("batch/v1", "Job"), ("apps/v1", "Deployment")}
    n_tasks = sum(config.counts().values())
    assert kinds.count(("batch/v1", "Job")) == n_tasks
    # One headless Service per task that listens: every task but the evaluators.
    headless = [d for d in objects if d["kind"] == "Service" and d["spec"].get("clusterIP")]
    assert len(headless) == n_tasks - config.evaluators
    assert all(d["spec"]["clusterIP"] == "None" for d in headless)
    assert (("apps/v1", "Deployment") in kinds) == config.tensorboard
    for d in objects:
        validate_k8s(d)
        assert d["metadata"].get("namespace") == config.namespace


# The fields of the Prometheus operator's PodMonitor (monitoring.coreos.com/v1, its CRD's
# PodMonitorSpec and PodMetricsEndpoint), the subset a rendered one may use; anything else, or a
# wrong type, fails. kubernetes-validate ships no CRD schemas, so this stands in for one.
POD_MONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        },
                        "matchExpressions": {"type": "array"},
                    },
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                            "scrapeTimeout": {
                                "type": "string",
                                "pattern": "^([0-9]+(ms|s|m|h))+$",
                            },
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}


def _pods(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d["spec"]["template"] for d in objects if d["kind"] == "Job"]


@pytest.mark.parametrize("target", ["kubernetes", "tfjob"])
def test_pods_carry_scrape_annotations_and_the_pod_monitor_selects_them(target: str) -> None:
    config = job(**K8S_JOBS["full"])
    objects = docs(render(config, target).text)
    if target == "tfjob":
        pods = [s["template"] for s in objects[0]["spec"]["tfReplicaSpecs"].values()]
    else:
        pods = _pods(objects)
    (monitor,) = [d for d in objects if d["kind"] == "PodMonitor"]
    jsonschema.validate(monitor, POD_MONITOR_SCHEMA)
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    scraped = 0
    for pod in pods:
        (container,) = pod["spec"]["containers"]
        assert env_of(container)["PSFLOW_METRICS_PORT"] == "9100"
        is_evaluator = pod["metadata"]["labels"]["app.kubernetes.io/component"] == "evaluator"
        if is_evaluator:
            # No address of its own (no Service): nothing Prometheus could reach.
            assert "annotations" not in pod["metadata"]
            assert "metrics" not in [p["name"] for p in container.get("ports", [])]
            continue
        scraped += 1
        assert pod["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": "9100",
            "prometheus.io/path": "/metrics",
        }
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports[endpoint["port"]] == 9100
        assert endpoint["path"] == "/metrics"
        assert (
            monitor["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        )
    # One pod template per replica type in a TFJob, one per task otherwise.
    counts = config.counts()
    expected = sum(n > 0 for j, n in counts.items() if j != "evaluator")
    if target == "kubernetes":
        expected = sum(counts.values()) - config.evaluators
    assert scraped == expected


def test_pod_monitor_schema_can_fail() -> None:
    config = job(**K8S_JOBS["full"])
    (monitor,) = [d for d in docs(render(config, "kubernetes").text) if d["kind"] == "PodMonitor"]
    monitor["spec"]["podMetricsEndpoints"][0]["targetPort"] = "metrics"  # not in v1's endpoint
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, POD_MONITOR_SCHEMA)


def test_no_metrics_no_annotations() -> None:
    objects = docs(render(job(metrics_port=0), "kubernetes").text)
    for pod in _pods(objects):
        assert "annotations" not in pod["metadata"]
        (container,) = pod["spec"]["containers"]
        assert "PSFLOW_METRICS_PORT" not in env_of(container)
        assert [p["name"] for p in container.get("ports", [])] == ["psflow"]
    with pytest.raises(ValueError, match="pod_monitor needs metrics"):
        job(metrics_port=0, pod_monitor=True)
    with pytest.raises(ValueError, match="metrics_port 2222 is the tasks' port"):
        job(metrics_port=2222)


def test_strict_validation_can_fail() -> None:
    (service, job_doc, *_) = docs(render(job(), "kubernetes").text)
    job_doc["spec"]["template"]["spec"]["tfConfig"] = "{}"  # not a PodSpec field
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_k8s(job_doc)
    service["apiVersion"] = "v2"
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        validate_k8s(service)


def test_kubernetes_pods_restart_on_failure_and_end_on_success() -> None:
    config = job(**K8S_JOBS["full"])
    text = render(config, "kubernetes").text
    # The manifests say that the restart policy plays psflow launch --max-restarts' part.
    assert text.count("(psflow launch --max-restarts, per task)") == text.count("kind: Job")
    assert text.count("--max-restarts` does locally") == text.count("kind: Job")
    tfjob = render(config, "tfjob").text
    assert "(psflow launch --max-restarts, counted for the job)" in tfjob
    for d in docs(text):
        if d["kind"] != "Job":
            continue
        pod = d["spec"]["template"]["spec"]
        # A Job's pod restarts in place on failure; exit 0 completes the Job (a finished ps).
        assert pod["restartPolicy"] == "OnFailure"
        assert d["spec"]["backoffLimit"] == 6
        (container,) = pod["containers"]
        assert container["args"] == ["python", "train.py", "--lr", "0.1", "it's"]
        assert "command" not in container  # the image's ENTRYPOINT stays
        env = env_of(container)
        assert env["PSFLOW_KEYS_DIR"] == "/etc/psflow/keys"
        assert env["PSFLOW_LOGDIR"] == "/logs"
        assert env["PSFLOW_TIMEOUT"] == "30"
        assert env["OMP_WAIT_POLICY"] == "PASSIVE"  # psflow.env.TASK_DEFAULTS
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["curve-keys"]["readOnly"] is True
        assert mounts["curve-keys"]["mountPath"] == "/etc/psflow/keys"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["curve-keys"]["secret"]["secretName"] == "mnist-keys"
        assert volumes["logdir"]["persistentVolumeClaim"]["claimName"] == "mnist-logs"
        resources = container["resources"]
        assert resources["requests"] == {"cpu": "1500m", "memory": "4Gi"}
        trainer = d["metadata"]["labels"]["app.kubernetes.io/component"] in ("chief", "worker")
        assert resources.get("limits", {}).get("nvidia.com/gpu") == (2 if trainer else None)


def test_kubernetes_defaults_to_empty_dir_and_no_keys() -> None:
    (_, job_doc, *_) = docs(render(job(), "kubernetes").text)
    pod = job_doc["spec"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "logdir", "emptyDir": {}}]
    assert "PSFLOW_KEYS_DIR" not in env_of(pod["containers"][0])
    assert "resources" not in pod["containers"][0]


def test_kubernetes_round_trip() -> None:
    config = job(**K8S_JOBS["full"])
    objects = docs(render(config, "kubernetes").text)
    expected = {
        jname: [f"mnist-{jname}-{i}:3000" for i in range(n)]
        for jname, n in config.counts().items()
        if n and jname != "evaluator"
    }
    services = [d for d in objects if d["kind"] == "Service" and d["spec"].get("clusterIP")]
    seen = []
    for d in objects:
        if d["kind"] != "Job":
            continue
        template = d["spec"]["template"]
        (container,) = template["spec"]["containers"]
        spec, task = ClusterSpec.from_tf_config(env_of(container)["TF_CONFIG"])
        assert spec.as_dict() == expected
        seen.append(task)
        labels = template["metadata"]["labels"]
        selecting = [
            s for s in services if s["spec"]["selector"].items() <= labels.items()
        ]  # the Services that route to this pod
        if task.job == "evaluator":
            assert selecting == [] and "ports" not in container
            continue
        (service,) = selecting
        host, port = spec.address(task).rsplit(":", 1)
        # The name the others dial is this pod's own Service, on the port the pod listens on.
        assert host == service["metadata"]["name"] == d["metadata"]["name"]
        assert int(port) == service["spec"]["ports"][0]["targetPort"]
        assert int(port) == container["ports"][0]["containerPort"]
    assert sorted(map(str, seen)) == sorted(
        str(TaskSpec(job=j, index=i)) for j, n in config.counts().items() for i in range(n)
    )


def test_tensorboard_objects() -> None:
    config = job(**K8S_JOBS["full"])
    objects = {
        (d["kind"], d["metadata"]["name"]): d for d in docs(render(config, "kubernetes").text)
    }
    deployment = objects[("Deployment", "mnist-tensorboard")]
    service = objects[("Service", "mnist-tensorboard")]
    pod = deployment["spec"]["template"]
    assert (
        deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (volume,) = pod["spec"]["volumes"]
    assert volume["persistentVolumeClaim"] == {"claimName": "mnist-logs", "readOnly": True}


# -- Kubeflow TFJob ----------------------------------------------------------------------------

# The fields of kubeflow.org/v1 TFJobSpec, RunPolicy and ReplicaSpec (training-operator's types);
# pod templates are checked separately, against core/v1.
TFJOB_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v1"},
        "kind": {"const": "TFJob"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["tfReplicaSpecs"],
            "additionalProperties": False,
            "properties": {
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                        "ttlSecondsAfterFinished": {"type": "integer"},
                        "activeDeadlineSeconds": {"type": "integer"},
                        "backoffLimit": {"type": "integer", "minimum": 0},
                        "suspend": {"type": "boolean"},
                    },
                },
                "successPolicy": {"type": "string"},
                "enableDynamicWorker": {"type": "boolean"},
                "tfReplicaSpecs": {
                    "type": "object",
                    "propertyNames": {"enum": ["Chief", "Master", "PS", "Worker", "Evaluator"]},
                    "additionalProperties": {
                        "type": "object",
                        "required": ["replicas", "template"],
                        "additionalProperties": False,
                        "properties": {
                            "replicas": {"type": "integer", "minimum": 1},
                            "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
                            "template": {"type": "object"},
                        },
                    },
                },
            },
        },
    },
}


def operator_tf_config(tfjob: dict[str, Any], rtype: str, index: int) -> str:
    """The TF_CONFIG Kubeflow's training operator sets (its genClusterSpec, in Python)."""
    namespace = tfjob["metadata"].get("namespace", "default")
    cluster = {}
    for replica_type, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        (container,) = [
            c for c in spec["template"]["spec"]["containers"] if c["name"] == "tensorflow"
        ]
        ports = [
            p["containerPort"] for p in container.get("ports", []) if p["name"] == "tfjob-port"
        ]
        port = ports[0] if ports else 2222
        rt = replica_type.lower()
        cluster[rt] = [
            f"{tfjob['metadata']['name']}-{rt}-{i}.{namespace}.svc:{port}"
            for i in range(spec["replicas"])
        ]
    task = {"type": rtype.lower(), "index": index}
    return json.dumps({"cluster": cluster, "task": task, "environment": "cloud"})


@pytest.mark.parametrize("variant", sorted(K8S_JOBS))
def test_tfjob_validates(variant: str) -> None:
    config = job(**K8S_JOBS[variant])
    (tfjob, *rest) = docs(render(config, "tfjob").text)
    jsonschema.validate(tfjob, TFJOB_SCHEMA)
    assert tfjob["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    replicas = {k: v["replicas"] for k, v in tfjob["spec"]["tfReplicaSpecs"].items()}
    names = {"chief": "Chief", "ps": "PS", "worker": "Worker", "evaluator": "Evaluator"}
    assert replicas == {names[j]: n for j, n in config.counts().items() if n}
    for spec in tfjob["spec"]["tfReplicaSpecs"].values():
        assert spec["restartPolicy"] == "OnFailure"
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
        validate_k8s({**template, "template": spec["template"]})
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"
        # The operator sets TF_CONFIG; a second one from us would be ambiguous.
        assert "TF_CONFIG" not in env_of(container)
    monitors = [d for d in rest if d["kind"] == "PodMonitor"]
    assert len(monitors) == int(config.pod_monitor)
    for d in monitors:
        jsonschema.validate(d, POD_MONITOR_SCHEMA)
    rest = [d for d in rest if d["kind"] != "PodMonitor"]
    assert [d["kind"] for d in rest] == (["Deployment", "Service"] if config.tensorboard else [])
    for d in rest:
        validate_k8s(d)


def test_tfjob_round_trip() -> None:
    config = job(**K8S_JOBS["full"])
    (tfjob, *_) = docs(render(config, "tfjob").text)
    expected = {
        jname: [f"mnist-{jname}-{i}.ml.svc:3000" for i in range(n)]
        for jname, n in config.counts().items()
        if n
    }
    for rtype, spec in tfjob["spec"]["tfReplicaSpecs"].items():
        for i in range(spec["replicas"]):
            cluster, task = ClusterSpec.from_tf_config(operator_tf_config(tfjob, rtype, i))
            assert cluster.as_dict() == expected
            # The operator names each pod's Service <tfjob>-<type>-<index>, as in the address.
            assert cluster.address(task) == f"mnist-{rtype.lower()}-{i}.ml.svc:3000"


# -- docker compose ----------------------------------------------------------------------------


def compose_config(**kw: Any) -> tuple[JobConfig, dict[str, Any]]:
    config = job(**kw)
    return config, yaml.safe_load(render(config, "compose").text)


@pytest.mark.parametrize("tensorboard", [False, True])
def test_compose_structure_and_round_trip(tensorboard: bool) -> None:
    config, doc = compose_config(
        chief=True,
        evaluators=1,
        gpus=1,
        cpu="500m",
        memory="2Gi",
        keys_host_dir="./keys",
        tensorboard=tensorboard,
        args=["--steps", "10"],
    )
    assert set(doc) == {"name", "services", "networks", "volumes"}
    assert doc["name"] == "mnist"
    assert doc["networks"] == {"cluster": {}}
    assert doc["volumes"] == {"logdir": {}}
    tasks = {k: v for k, v in doc["services"].items() if k != "mnist-tensorboard"}
    assert len(tasks) == sum(config.counts().values())
    assert ("mnist-tensorboard" in doc["services"]) == tensorboard
    for name, service in tasks.items():
        assert set(service) <= {
            "image", "hostname", "command", "environment", "volumes", "networks", "restart",
            "deploy",
        }  # fmt: skip
        assert service["networks"] == ["cluster"]
        assert service["restart"] == "on-failure"
        assert service["command"] == ["python", "train.py", "--steps", "10"]
        spec, task = ClusterSpec.from_tf_config(service["environment"]["TF_CONFIG"])
        assert spec.as_dict() == {
            "chief": ["mnist-chief-0:2222"],
            "ps": ["mnist-ps-0:2222"],
            "worker": ["mnist-worker-0:2222", "mnist-worker-1:2222"],
        }
        assert name == config.task_name(task.job, task.index) == service["hostname"]
        if task.job != "evaluator":
            assert spec.address(task) == f"{name}:2222"
        logdir, keys = service["volumes"]
        assert logdir == {"type": "volume", "source": "logdir", "target": "/logs"}
        assert keys == {
            "type": "bind", "source": "./keys", "target": "/etc/psflow/keys", "read_only": True
        }  # fmt: skip
        assert service["environment"]["PSFLOW_KEYS_DIR"] == "/etc/psflow/keys"
        reservations = service["deploy"]["resources"]["reservations"]
        assert reservations["cpus"] == "0.5" and reservations["memory"] == "2g"
        gpu = reservations.get("devices")
        assert gpu == ([{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
                       if task.job in ("chief", "worker") else None)  # fmt: skip


def test_compose_host_logdir() -> None:
    _, doc = compose_config(logdir_host_dir="./logs")
    assert "volumes" not in doc
    for service in doc["services"].values():
        assert service["volumes"] == [{"type": "bind", "source": "./logs", "target": "/logs"}]


def test_docker_compose_config_accepts_it(tmp_path: Path) -> None:
    docker = shutil.which("docker")
    plugin = docker and subprocess.run(
        [docker, "compose", "version"], capture_output=True, timeout=30
    )
    if not plugin or plugin.returncode != 0:
        pytest.skip("the docker compose plugin is not installed")
    path = tmp_path / "compose.yaml"
    config = job(chief=True, gpus=1, memory="1Gi", cpu="1", keys_host_dir="k", tensorboard=True)
    path.write_text(render(config, "compose").text)
    out = subprocess.run(
        [docker, "compose", "-f", str(path), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr


# -- Marathon ----------------------------------------------------------------------------------


def test_marathon_structure_and_round_trip() -> None:
    config = job(
        chief=True,
        ps=2,
        evaluators=1,
        gpus=1,
        cpu="2",
        memory="3Gi",
        logdir_host_dir="/data/mnist",
        keys_host_dir="/etc/mnist-keys",
        tensorboard=True,
        port=4000,
    )
    group = json.loads(render(config, "marathon").text)
    assert group["id"] == "/mnist"
    apps = {a["id"]: a for a in group["apps"]}
    assert list(apps) == [
        "chief-0", "ps-0", "ps-1", "worker-0", "worker-1", "evaluator-0", "tensorboard"
    ]  # fmt: skip
    seen_ports = set()
    for app_id, app in apps.items():
        assert app["instances"] == 1
        assert app["container"]["type"] == "MESOS"
        assert app["container"]["docker"]["image"] == "psflow:0.1.0"
        assert app["networks"] == [{"mode": "host"}]
        assert "cmd" not in app  # `args` keeps the image's ENTRYPOINT
        if app_id == "tensorboard":
            continue
        assert (app["cpus"], app["mem"]) == (2.0, 3072)
        assert app["gpus"] == (1 if app_id.startswith(("chief", "worker")) else 0)
        assert app["args"] == ["python", "train.py"]
        volumes = {
            v["containerPath"]: (v["hostPath"], v["mode"]) for v in app["container"]["volumes"]
        }
        assert volumes == {
            "/logs": ("/data/mnist", "RW"),
            "/etc/psflow/keys": ("/etc/mnist-keys", "RO"),
        }
        spec, task = ClusterSpec.from_tf_config(app["env"]["TF_CONFIG"])
        assert app_id == f"{task.job}-{task.index}"
        assert spec.num_tasks("ps") == 2 and spec.num_tasks("worker") == 2
        if task.job == "evaluator":
            assert app["portDefinitions"] == []
            continue
        # Mesos-DNS names the app /mnist/<id> as <id>-mnist.marathon.mesos.
        host, port = spec.address(task).rsplit(":", 1)
        assert host == f"{app_id}-{group['id'].strip('/')}.marathon.mesos"
        (definition,) = app["portDefinitions"]
        assert definition["port"] == int(port) and app["requirePorts"] is True
        seen_ports.add(int(port))
    assert seen_ports == set(range(4000, 4005))


def test_marathon_minimal_has_no_volumes() -> None:
    group = json.loads(render(job(), "marathon").text)
    assert [a["container"]["volumes"] for a in group["apps"]] == [[], [], []]
    assert group["apps"][0]["mem"] == 1024  # never Marathon's 128 MiB default


# -- templates ---------------------------------------------------------------------------------


def test_template_dir_overrides_one_file(tmp_path: Path) -> None:
    (tmp_path / "compose.yaml.j2").write_text(
        "name: {{ job.name | q }}\nx-tasks: {{ tasks | length }}\n"
    )
    out = render(job(), "compose", template_dir=tmp_path)
    assert yaml.safe_load(out.text) == {"name": "mnist", "x-tasks": 3}
    # The other targets still come from the package.
    assert "kind: Job" in render(job(), "kubernetes", template_dir=tmp_path).text


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            "{{ no_such_variable }}",
            "template compose.yaml.j2 failed: 'no_such_variable' is undefined",
        ),
        ("a: [unclosed\n", "rendered invalid output"),
        ("{% if %}", "template compose.yaml.j2 failed"),
    ],
)
def test_bad_templates_fail_clearly(tmp_path: Path, template: str, message: str) -> None:
    (tmp_path / "compose.yaml.j2").write_text(template)
    with pytest.raises(ValueError, match=message):
        render(job(), "compose", template_dir=tmp_path)


def test_missing_template_dir() -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        render(job(), "compose", template_dir="/nonexistent/templates")


def test_templates_ship_as_package_data() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["psflow.deploy"]
    templates = ROOT / "psflow" / "deploy" / "templates"
    files = [
        p.relative_to(templates.parent).as_posix() for p in templates.rglob("*") if p.is_file()
    ]
    assert len(files) >= 4
    for f in files:
        assert any(fnmatch(f, pat) for pat in patterns), f"{f} would not ship in the wheel"


# -- the evaluator -----------------------------------------------------------------------------


def _task_runs(target: str, config: JobConfig) -> dict[str, dict[str, Any]]:
    """Per task (``chief``, ``evaluator``): what runs, its environment (with the TF_CONFIG it
    gets) and the logdir it sees, as the target describes them."""
    text = render(config, target).text
    out: dict[str, dict[str, Any]] = {}
    if target == "kubernetes":
        for d in docs(text):
            if d["kind"] == "Job":
                pod = d["spec"]["template"]["spec"]
                (c,) = pod["containers"]
                job_name = d["metadata"]["labels"]["app.kubernetes.io/component"]
                out[job_name] = {"cmd": c["args"], "env": env_of(c), "logdir": pod["volumes"]}
    elif target == "tfjob":
        (tfjob, *_) = docs(text)
        for rtype, spec in tfjob["spec"]["tfReplicaSpecs"].items():
            pod = spec["template"]["spec"]
            (c,) = pod["containers"]
            env = {**env_of(c), "TF_CONFIG": operator_tf_config(tfjob, rtype, 0)}
            out[rtype.lower()] = {"cmd": c["args"], "env": env, "logdir": pod["volumes"]}
    elif target == "compose":
        for name, s in yaml.safe_load(text)["services"].items():
            if "-chief-" in name or "-evaluator-" in name:
                job_name = name.split("-")[-2]
                out[job_name] = {
                    "cmd": s["command"],
                    "env": s["environment"],
                    "logdir": s["volumes"],
                }
    else:
        for app in json.loads(text)["apps"]:
            if app["id"] in ("chief-0", "evaluator-0"):
                vols = app["container"]["volumes"]
                out[app["id"][:-2]] = {"cmd": app["args"], "env": app["env"], "logdir": vols}
    return out


@pytest.mark.parametrize("target", ["kubernetes", "tfjob", "compose", "marathon"])
def test_the_evaluator_runs_the_script_on_the_chiefs_logdir(target: str) -> None:
    config = job(chief=True, evaluators=1, logdir_claim="logs", logdir_host_dir="/srv/logs")
    runs = _task_runs(target, config)
    chief, evaluator = runs["chief"], runs["evaluator"]
    assert evaluator["cmd"] == chief["cmd"] == ["python", "train.py"]
    assert evaluator["logdir"] == chief["logdir"]  # the same shared volume
    assert evaluator["env"]["PSFLOW_LOGDIR"] == chief["env"]["PSFLOW_LOGDIR"] == "/logs"
    # What the script's `ctx.is_evaluator` branch reads (TFJob: the operator's form, with the
    # evaluator inside `cluster`).
    ctx, _ = resolve([], environ={"TF_CONFIG": evaluator["env"]["TF_CONFIG"]})
    assert ctx.is_evaluator and not ctx.is_chief
    chief_ctx, _ = resolve([], environ={"TF_CONFIG": chief["env"]["TF_CONFIG"]})
    assert chief_ctx.is_chief and not chief_ctx.is_evaluator
