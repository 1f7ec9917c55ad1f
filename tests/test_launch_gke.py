"""The GKE JobSet renderer: manifests that validate, map jaxscale's contract, and refuse bad input.

Validation, without a cluster: the JobSet-level fields against the JobSet v1alpha2 CRD schema
(vendored excerpt, tests/fixtures/jobset-v1alpha2-schema.yaml) with unknown fields rejected as the
API server's strict field validation would; the embedded Job template against the Kubernetes
client's V1JobTemplateSpec model by a lossless round trip (a misspelt field is dropped and a wrong
type is coerced, so either shows up as a difference). Not checked: CEL rules, admission webhooks.
"""

import json
import os
import subprocess
import sys

import jsonschema
import pytest
import yaml
from kubernetes import client

from jaxscale.distributed import ClusterSpec, detect
from jaxscale.errors import RESTART_EXIT_CODE, USAGE_EXIT_CODE

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(REPO, "tests", "fixtures", "jobset-v1alpha2-schema.yaml")
RENDER = [sys.executable, "-m", "jaxscale.launch.gke"]
GPU_ARGS = ["--config=configs/tiny.py", "--nodes=2", "--gpus_per_node=8", "--image=img:1",
            "--bucket=ckpts", "--name=tiny"]
TPU_ARGS = ["--config=configs/tiny.py", "--tpu_accelerator=tpu-v5p-slice", "--tpu_topology=2x2x2",
            "--slices=2", "--image=img:1", "--pvc=shared", "--name=tiny",
            "--config.mesh.dcn.data=2"]


def render(args):
    result = subprocess.run([*RENDER, *args], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def gpu_jobset():
    return render(GPU_ARGS)


@pytest.fixture(scope="module")
def tpu_jobset():
    return render([*TPU_ARGS, "--config.train.steps=7"])


def closed(schema):
    """The schema with unknown fields rejected wherever it lists the known ones."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema


def strip_none(value):
    if isinstance(value, dict):
        return {k: strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_none(v) for v in value]
    return value


def assert_valid_jobset(jobset):
    with open(SCHEMA) as f:
        jsonschema.validate(jobset, closed(yaml.safe_load(f)))
    api = client.ApiClient()
    for rjob in jobset["spec"]["replicatedJobs"]:
        template = rjob["template"]
        model = api._ApiClient__deserialize(template, "V1JobTemplateSpec")
        assert strip_none(api.sanitize_for_serialization(model)) == template


@pytest.mark.parametrize("fixture", ["gpu_jobset", "tpu_jobset"])
def test_manifests_validate(fixture, request):
    assert_valid_jobset(request.getfixturevalue(fixture))


def test_validation_catches_a_misspelt_field(gpu_jobset):
    broken = json.loads(json.dumps(gpu_jobset))
    pod = broken["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["terminationGracePeriod"] = pod.pop("terminationGracePeriodSeconds")
    with pytest.raises(AssertionError):
        assert_valid_jobset(broken)
    broken = json.loads(json.dumps(gpu_jobset))
    broken["spec"]["network"]["enableDnsHostnames"] = True
    with pytest.raises(jsonschema.ValidationError):
        assert_valid_jobset(broken)


def job_and_pod(jobset):
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    return job, job["template"]["spec"]


def test_gpu_jobset_is_a_gang_of_indexed_pods(gpu_jobset):
    job, pod = job_and_pod(gpu_jobset)
    assert gpu_jobset["spec"]["replicatedJobs"][0]["replicas"] == 1
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", 2, 2)
    assert gpu_jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "jaxscale"
    assert pod["priorityClassName"] == "jaxscale-normal"
    assert gpu_jobset["spec"]["network"] == {"enableDNSHostnames": True,
                                             "publishNotReadyAddresses": True}
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert container["command"] == ["python", "-m", "jaxscale.train", "--config=configs/tiny.py",
                                    "--workdir=/checkpoints/tiny"]


def test_checkpoints_live_on_the_mounted_bucket(gpu_jobset):
    job, pod = job_and_pod(gpu_jobset)
    volume = next(v for v in pod["volumes"] if v["name"] == "checkpoints")
    assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    assert volume["csi"]["volumeAttributes"]["bucketName"] == "ckpts"
    assert job["template"]["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["checkpoints"] == "/checkpoints"


def test_restart_policy_follows_the_exit_status(gpu_jobset):
    job, pod = job_and_pod(gpu_jobset)
    rules = job["podFailurePolicy"]["rules"]
    by_code = {r["onExitCodes"]["values"][0]: r["action"] for r in rules if "onExitCodes" in r}
    assert by_code == {RESTART_EXIT_CODE: "Ignore", USAGE_EXIT_CODE: "FailJob"}
    assert pod["restartPolicy"] == "Never" and job["backoffLimit"] == 0
    policy = gpu_jobset["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 10
    assert policy["rules"] == [{"name": "FailOnUsageError", "action": "FailJobSet",
                                "onJobFailureReasons": ["PodFailurePolicy"]}]
    assert pod["terminationGracePeriodSeconds"] == 300


def test_tpu_jobset_has_one_job_per_slice(tpu_jobset):
    job, pod = job_and_pod(tpu_jobset)
    rjob = tpu_jobset["spec"]["replicatedJobs"][0]
    assert rjob["replicas"] == 2 and job["parallelism"] == 2  # 8 chips / 4 per host
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": "4"}
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                   "cloud.google.com/gke-tpu-topology": "2x2x2"}
    assert tpu_jobset["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    assert pod["containers"][0]["command"][-2:] == ["--config.mesh.dcn.data=2",
                                                    "--config.train.steps=7"]
    assert pod["volumes"] == [{"name": "checkpoints",
                               "persistentVolumeClaim": {"claimName": "shared"}}]


def test_pods_detect_the_gke_mode_and_agree_on_the_coordinator(gpu_jobset):
    _, pod = job_and_pod(gpu_jobset)
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"] if "value" in e}
    label = next(e for e in pod["containers"][0]["env"] if e["name"] == "JOB_INDEX")
    assert "jobset.sigs.k8s.io/job-index" in label["valueFrom"]["fieldRef"]["fieldPath"]
    # What Kubernetes and JobSet add to pod 1 of job 0.
    spec = detect({**env, "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": "1"})
    assert spec == ClusterSpec("gke", "tiny-workers-0-0.tiny:8476", 2, 1)


def test_kueue_setup_defines_the_default_queue_and_priority_classes():
    with open(os.path.join(REPO, "launch", "gke", "kueue.yaml")) as f:
        docs = list(yaml.safe_load_all(f))
    by_kind = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("LocalQueue", "jaxscale"), ("ClusterQueue", "jaxscale"),
            ("PriorityClass", "jaxscale-normal"), ("PriorityClass", "jaxscale-high")} <= by_kind
    api = client.ApiClient()
    for d in docs:
        if d["kind"] == "PriorityClass":
            model = api._ApiClient__deserialize(d, "V1PriorityClass")
            assert strip_none(api.sanitize_for_serialization(model)) == d


@pytest.mark.parametrize("args, message", [
    ([a for a in GPU_ARGS if not a.startswith("--image")],
     "the following arguments are required: --image"),
    ([*GPU_ARGS, "--config.mesh.tensor=32"], "16 devices per slice are not divisible by 32"),
    ([*GPU_ARGS, "--config.mesh.dcn.data=4"], "multiply to 4 but there are 2 slices/hosts"),
    ([*GPU_ARGS, "--gpus_per_node=3"], "batch"),
    ([a for a in GPU_ARGS if not a.startswith("--nodes")], "pass --nodes=N"),
    ([*GPU_ARGS, "--name=Bad_Name"], "--name='Bad_Name'"),
    ([*TPU_ARGS, "--tpu_topology=2x2x3", "--chips_per_node=8"], "not a multiple"),
    ([*GPU_ARGS, "--bogus=1"], "unrecognized arguments: --bogus=1"),
    ([*GPU_ARGS, "--max_restarts=-1"], "argument --max_restarts: -1 must be >= 0"),
])
def test_bad_input_is_one_error_line_and_no_manifest(args, message):
    result = subprocess.run([*RENDER, *args], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
