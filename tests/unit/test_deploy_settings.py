"""Cluster settings of ``psflow render``: where each lands in every target, and bad input.

A setting either shows up in the manifest where the cluster reads it, or the render fails with
one line naming the field: nothing is dropped silently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from psflow.deploy import JobConfig, render
from psflow.deploy.cli import parse_toleration
from psflow.deploy.settings import check_image

pytestmark = pytest.mark.unit

BASE: dict[str, Any] = {"name": "ads", "image": "psflow:0.1.0", "script": "train.py"}
SETTINGS: dict[str, Any] = {
    "cpu": "1",
    "memory": "2Gi",
    "cpu_limit": "2",
    "memory_limit": "4Gi",
    "node_selector": {"pool": "cpu"},
    "tolerations": [
        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    ],
    "priority_class": "high",
    "service_account": "ads-trainer",
    "data_claim": "criteo",
    "queue": "team-ads",
    "image_pull_policy": "Always",
    "image_pull_secrets": ["regcred"],
}


def job(**kw: Any) -> JobConfig:
    return JobConfig(**{**BASE, **kw})


def pod_specs(target: str, text: str) -> list[dict[str, Any]]:
    out = []
    for d in yaml.safe_load_all(text):
        if not d:
            continue
        if d["kind"] == "Job" and target == "kubernetes":
            out.append(d["spec"]["template"]["spec"])
        elif d["kind"] == "TFJob":
            out += [r["template"]["spec"] for r in d["spec"]["tfReplicaSpecs"].values()]
        elif d["kind"] == "ClusterTrainingRuntime":
            out += [
                r["template"]["spec"]["template"]["spec"]
                for r in d["spec"]["template"]["spec"]["replicatedJobs"]
            ]
        elif d["kind"] == "Job" and target == "volcano":
            out += [t["template"]["spec"] for t in d["spec"]["tasks"]]
    return out


@pytest.mark.parametrize("target", ["kubernetes", "tfjob", "trainer", "volcano"])
def test_every_setting_lands_in_every_pod(target: str) -> None:
    text = render(job(**SETTINGS), target).text
    specs = pod_specs(target, text)
    assert len(specs) >= 2
    for spec in specs:
        assert spec["nodeSelector"] == {"pool": "cpu"}
        assert spec["tolerations"] == SETTINGS["tolerations"]
        assert spec["priorityClassName"] == "high"
        assert spec["serviceAccountName"] == "ads-trainer"
        assert spec["imagePullSecrets"] == [{"name": "regcred"}]
        (c,) = spec["containers"]
        assert c["imagePullPolicy"] == "Always"
        assert c["resources"]["requests"] == {"cpu": "1", "memory": "2Gi"}
        assert c["resources"]["limits"] == {"cpu": "2", "memory": "4Gi"}
        (data,) = [m for m in c["volumeMounts"] if m["name"] == "data"]
        assert data == {"name": "data", "mountPath": "/data", "readOnly": True}
        (vol,) = [v for v in spec["volumes"] if v["name"] == "data"]
        assert vol["persistentVolumeClaim"] == {"claimName": "criteo", "readOnly": True}
    objects = [d for d in yaml.safe_load_all(text) if d]
    if target == "volcano":
        assert objects[0]["spec"]["queue"] == "team-ads"
        assert objects[0]["spec"]["priorityClassName"] == "high"
    else:
        # Kueue admits what carries its queue label: each Job, the TFJob, the TrainJob.
        queued = [d for d in objects if "kueue.x-k8s.io/queue-name" in d["metadata"]["labels"]]
        kinds = {"kubernetes": {"Job"}, "tfjob": {"TFJob"}, "trainer": {"TrainJob"}}[target]
        assert queued and {d["kind"] for d in queued} == kinds
        assert all(
            d["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-ads" for d in queued
        )


def test_trainjob_carries_the_workers_resources() -> None:
    text = render(job(**SETTINGS, gpus=2), "trainer").text
    trainjob = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "TrainJob")
    assert trainjob["spec"]["trainer"]["resourcesPerNode"] == {
        "requests": {"cpu": "1", "memory": "2Gi"},
        "limits": {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": 2},
    }


def test_compose_takes_limits_pull_policy_and_a_data_dir() -> None:
    text = render(
        job(
            cpu_limit="2",
            memory_limit="4Gi",
            image_pull_policy="IfNotPresent",
            data_host_dir="/srv/criteo",
        ),
        "compose",
    ).text
    services = yaml.safe_load(text)["services"]
    for s in services.values():
        assert s["pull_policy"] == "missing"
        assert s["deploy"]["resources"]["limits"] == {"cpus": "2.0", "memory": "4g"}
        assert {"type": "bind", "source": "/srv/criteo", "target": "/data", "read_only": True} in s[
            "volumes"
        ]


def test_marathon_mounts_the_data_dir() -> None:
    apps = json.loads(render(job(data_host_dir="/srv/criteo"), "marathon").text)["apps"]
    for app in apps:
        assert {"containerPath": "/data", "hostPath": "/srv/criteo", "mode": "RO"} in app[
            "container"
        ]["volumes"]


@pytest.mark.parametrize(
    ("target", "kw", "message"),
    [
        ("kubernetes", {"ps": 0, "mode": "sync"}, "^ps: mode sync needs at least one ps task"),
        ("kubernetes", {"ps": 0, "env": {"PSFLOW_MODE": "async"}}, "^ps: mode async needs"),
        ("trainer", {"ps": 2, "mode": "allreduce"}, "^ps: mode allreduce runs without ps"),
        ("volcano", {"mode": "turbo"}, "^mode 'turbo' must be one of"),
        ("kubernetes", {"mode": "sync", "env": {"PSFLOW_MODE": "sync"}}, "give the mode once"),
        (
            "volcano",
            {"quota": {"pods": 2}},
            r"^quota pods: the job's 3 pods ask pods 3 in all, more than the quota's 2",
        ),
        (
            "trainer",
            {"cpu": "4", "quota": {"cpu": "8"}},
            r"^quota cpu: the job's 3 pods ask cpu 12 in all",
        ),
        ("trainer", {"gpus": 1, "quota": {"nvidia.com/gpu": 1}}, "^quota nvidia.com/gpu:"),
        ("trainer", {"quota": {"memory": "8Gi"}}, "^quota memory: the job states no memory"),
        ("trainer", {"quota": {"disks": 1}}, "^quota 'disks' is not one psflow checks"),
        ("kubernetes", {"image": "Psflow:0.1"}, "^image 'Psflow:0.1' is not an image reference"),
        ("kubernetes", {"image": "psflow::1"}, "^image 'psflow::1'"),
        ("kubernetes", {"image": "reg.io/psflow@sha256:xyz"}, "^image 'reg.io/psflow@sha256:xyz'"),
        ("kubernetes", {"image": "-psflow"}, "^image '-psflow'"),
        ("kubernetes", {"cpu_limit": "lots"}, "^cpu_limit 'lots' is not a Kubernetes quantity"),
        ("kubernetes", {"memory_limit": "1Gi", "memory": "2Gi"}, "^memory_limit '1Gi' is below"),
        ("kubernetes", {"memory_limit": "512m"}, "did you mean 512Mi"),
        ("kubernetes", {"node_selector": {"pool": "a b"}}, "^node_selector pool 'a b' is not"),
        ("kubernetes", {"node_selector": {"-x": "a"}}, "^node_selector key '-x'"),
        ("kubernetes", {"node_selector": ["pool=a"]}, "^node_selector must map"),
        (
            "kubernetes",
            {"tolerations": [{"key": "a", "efect": "NoSchedule"}]},
            r"^tolerations\[0\] has unknown",
        ),
        (
            "kubernetes",
            {"tolerations": [{"key": "a", "effect": "NoRun"}]},
            r"^tolerations\[0\].effect",
        ),
        (
            "kubernetes",
            {"tolerations": [{"key": "a", "operator": "Exists", "value": "b"}]},
            r"^tolerations\[0\]: operator Exists takes no value",
        ),
        ("kubernetes", {"tolerations": [{"key": "a", "tolerationSeconds": 5}]}, "NoExecute"),
        ("kubernetes", {"priority_class": "High"}, "^priority_class 'High' is not a valid"),
        ("kubernetes", {"service_account": "Ads"}, "^service_account 'Ads' is not a valid"),
        ("compose", {"service_account": "ads"}, "^service_account is a Kubernetes setting"),
        ("kubernetes", {"data_claim": "_x"}, "^data_claim '_x'"),
        ("kubernetes", {"data_dir": "data"}, "^data_dir 'data' must be an absolute path"),
        ("kubernetes", {"data_dir": "/logs"}, "^data_dir '/logs' is also the logdir"),
        ("kubernetes", {"image_pull_policy": "always"}, "^image_pull_policy 'always' must be one"),
        ("kubernetes", {"image_pull_secrets": ["Reg"]}, "^image_pull_secrets: 'Reg' is not"),
        ("kubernetes", {"gang": "yes"}, "^gang 'yes' must be one of volcano, coscheduling"),
        ("kubernetes", {"gang": "coscheduling"}, "^gang coscheduling is for target trainer"),
        ("tfjob", {"gang": "volcano"}, "^gang: the v1 training operator"),
        ("compose", {"gang": "volcano"}, "^gang: compose has no gang scheduler"),
        ("compose", {"node_selector": {"a": "b"}}, "^node_selector is a Kubernetes setting"),
        ("marathon", {"queue": "q"}, "^queue is a Kubernetes setting: marathon"),
        ("marathon", {"cpu_limit": "2"}, "^cpu_limit: marathon's cpus"),
        ("kubernetes", {"data_host_dir": "/srv"}, "^data_host_dir is for compose and marathon"),
        ("trainer", {"workers": 0, "chief": True}, "^workers: trainer needs at least one worker"),
        ("trainer", {"runtime_kind": "Runtime"}, "^runtime_kind 'Runtime' must be one of"),
        (
            "trainer",
            {"name": "a" * 50, "evaluators": 1, "logdir_claim": "logs"},
            "^name 'a{50}' is too long for trainer: pod host name 'a{50}-evaluator-0-0' has 64",
        ),
        ("kubernetes", {"queue": "team ads"}, "^queue 'team ads' is not a valid"),
    ],
)
def test_bad_input_fails_with_one_line_naming_the_field(
    target: str, kw: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message) as info:
        render(job(**kw), target)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "image",
    [
        "psflow",
        "psflow:0.1.0",
        "registry.example.com/ml/psflow:0.1.0",
        "localhost:5000/psflow",
        "ghcr.io/org/psflow_ctr-x:v1.2.3-rc.1",
        "psflow@sha256:" + "a" * 64,
        "reg.io:443/a/b/c:t@sha256:" + "0" * 64,
    ],
)
def test_image_references_kubernetes_accepts(image: str) -> None:
    check_image(image)


def test_toleration_flags() -> None:
    assert parse_toleration("dedicated=ml:NoSchedule") == {
        "key": "dedicated",
        "operator": "Equal",
        "value": "ml",
        "effect": "NoSchedule",
    }
    assert parse_toleration("spot:NoExecute") == {
        "key": "spot",
        "operator": "Exists",
        "effect": "NoExecute",
    }
    assert parse_toleration("gpu") == {"key": "gpu", "operator": "Exists"}
    with pytest.raises(ValueError, match="KEY"):
        parse_toleration("=x")


def test_flags_and_values_file_as_a_process(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        "name: ads\nimage: reg.example.com/ads:1\nps: 2\nworkers: 2\n"
        "node_selector: {pool: cpu}\nquota: {pods: 8}\nscript: train.py\n"
    )
    cmd = [sys.executable, "-m", "psflow.cli", "render", "trainer", "--values", str(values)]
    out = subprocess.run(
        [
            *cmd,
            "--toleration",
            "dedicated=ml:NoSchedule",
            "--quota",
            "cpu=8",
            "--cpu",
            "1",
            "--image-pull-secret",
            "regcred",
            "--queue",
            "team-ads",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    objects = [d for d in yaml.safe_load_all(out) if d]
    spec = pod_specs("trainer", out)[0]
    assert spec["nodeSelector"] == {"pool": "cpu"}
    assert spec["tolerations"] == [parse_toleration("dedicated=ml:NoSchedule")]
    assert objects[1]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-ads"
    bad = subprocess.run([*cmd, "--quota", "pods=3"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "psflow render: error: quota pods: the job's 4 pods ask pods 4 in all, more than the "
        "quota's 3: its gang could never be scheduled whole"
    ]
