"""The GKE JobSet renderer and its image: manifests that validate, map jaxscale's contract, run
hardened, and refuse bad input; a Dockerfile whose user and versions match. What the JobSet does
with each exit status is in tests/test_faults_launch.py.

Validation, without a cluster: the JobSet-level fields against the JobSet v1alpha2 CRD schema
(vendored excerpt, tests/fixtures/jobset-v1alpha2-schema.yaml) with unknown fields rejected as the
API server's strict field validation would; the embedded Job template against the Kubernetes
client's V1JobTemplateSpec model by a lossless round trip (a misspelt field is dropped and a wrong
type is coerced, so either shows up as a difference). Not checked: CEL rules, admission webhooks.
"""

import json
import os
import re
import subprocess
import sys

import jsonschema
import pytest
import yaml
from kubernetes import client

from jaxscale.launch.gke import RUN_AS, Shape, parse_args
from jaxscale.launch.gke import render as render_jobset
from jaxscale.runtime.distributed import ClusterSpec, detect, host_slot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(REPO, "tests", "fixtures", "jobset-v1alpha2-schema.yaml")
RENDER = [sys.executable, "-m", "jaxscale.launch.gke"]
# --no_compile: the step's compile for the GPUs is tests/test_gpu_compile.py's.
GPU_ARGS = ["--config=configs/tiny.py", "--nodes=2", "--gpus_per_node=8", "--image=img:1",
            "--bucket=ckpts", "--name=tiny", "--no_compile"]
TPU_ARGS = ["--config=configs/tiny.py", "--tpu_accelerator=tpu-v5p-slice", "--tpu_topology=2x2x2",
            "--slices=2", "--image=img:1", "--pvc=shared", "--name=tiny",
            "--config.mesh.dcn.data=2"]
DOCKERFILE = os.path.join(REPO, "deploy", "Dockerfile")
RESULTS = os.path.join(REPO, "benchmarks", "RESULTS.md")


def render(args):
    result = subprocess.run([*RENDER, *args], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def gpu_jobset():
    return render(GPU_ARGS)


@pytest.fixture(scope="module")
def local_tier_jobset():
    return render([*GPU_ARGS, "--node_local_dir=/mnt/disks/ssd0/jaxscale",
                   "--config.checkpoint.local_every_steps=50"])


@pytest.fixture(scope="module")
def tpu_jobset():
    return render([*TPU_ARGS, "--service_account=trainer", "--cpu=10", "--memory_gib=64",
                   "--shm_gib=8", "--config.train.steps=7"])


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


@pytest.mark.parametrize("fixture", ["gpu_jobset", "tpu_jobset", "local_tier_jobset"])
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
    assert pod["terminationGracePeriodSeconds"] == 300
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it


def test_checkpoints_go_to_the_bucket_through_orbax_and_the_workdir_through_fuse(gpu_jobset):
    job, pod = job_and_pod(gpu_jobset)
    assert pod["containers"][0]["command"] == [
        "python", "-m", "jaxscale.train", "--config=configs/tiny.py", "--workdir=/workdir/tiny",
        "--config.checkpoint.dir=gs://ckpts/tiny/checkpoints"]
    volume = next(v for v in pod["volumes"] if v["name"] == "workdir")
    assert volume["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    assert volume["csi"]["volumeAttributes"]["bucketName"] == "ckpts"
    options = volume["csi"]["volumeAttributes"]["mountOptions"].split(",")
    assert {"implicit-dirs", f"uid={RUN_AS}", f"gid={RUN_AS}"} <= set(options)
    assert job["template"]["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["workdir"] == "/workdir"


def test_a_checkpoint_dir_of_the_users_own_is_kept():
    args, overrides = parse_args([*GPU_ARGS, "--config.checkpoint.dir=gs://other/run"])
    command = render_jobset(args, Shape(args), overrides)["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert [a for a in command if a.startswith("--config.checkpoint.dir=")] == [
        "--config.checkpoint.dir=gs://other/run"]


def test_the_local_tier_is_a_folder_of_the_node_that_outlives_the_pod(local_tier_jobset):
    """A pod that exits 42 is replaced by a new one (restartPolicy Never): only a folder of the
    node, not an emptyDir of the pod, is still there for it."""
    _, pod = job_and_pod(local_tier_jobset)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert volumes[mounts["/local-checkpoints"]]["hostPath"] == {
        "path": "/mnt/disks/ssd0/jaxscale", "type": "DirectoryOrCreate"}
    command = pod["containers"][0]["command"]
    assert command[-2:] == ["--config.checkpoint.local_dir=/local-checkpoints/tiny",
                            "--config.checkpoint.local_every_steps=50"]
    assert "--config.checkpoint.dir=gs://ckpts/tiny/checkpoints" in command  # the persistent tier
    _, plain = job_and_pod(render(GPU_ARGS))
    assert not any("hostPath" in v for v in plain["volumes"])
    assert not any(a.startswith("--config.checkpoint.local_dir") for a in
                   plain["containers"][0]["command"])
    args, overrides = parse_args([*GPU_ARGS, "--node_local_dir=/mnt/x",
                                  "--config.checkpoint.local_dir=/local-checkpoints/mine"])
    command = render_jobset(args, Shape(args), overrides)["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    assert [a for a in command if a.startswith("--config.checkpoint.local_dir=")] == [
        "--config.checkpoint.local_dir=/local-checkpoints/mine"]


def test_pods_run_as_the_images_non_root_user_without_privileges(gpu_jobset):
    _, pod = job_and_pod(gpu_jobset)
    assert pod["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
        "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}
    container = pod["containers"][0]
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True}
    # The root filesystem is read-only: HOME and /tmp are a volume of the pod's own.
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HOME"] == "/tmp"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/tmp"]] == {"name": "tmp", "emptyDir": {}}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


def test_no_service_account_token_unless_a_service_account_is_named(gpu_jobset, tpu_jobset):
    _, pod = job_and_pod(gpu_jobset)
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    _, pod = job_and_pod(tpu_jobset)
    assert pod["automountServiceAccountToken"] is True
    assert pod["serviceAccountName"] == "trainer"


def test_pods_request_cpu_and_memory_for_kueue(gpu_jobset, tpu_jobset):
    _, pod = job_and_pod(gpu_jobset)  # the defaults: 8 CPUs and 40 GiB per GPU
    assert pod["containers"][0]["resources"]["requests"] == {"cpu": "64", "memory": "320Gi"}
    _, pod = job_and_pod(tpu_jobset)  # given
    assert pod["containers"][0]["resources"]["requests"] == {"cpu": "10", "memory": "64Gi"}
    dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["sizeLimit"] == "8Gi"
    shape = Shape(parse_args(TPU_ARGS)[0])  # the defaults: 24 CPUs and 32 GiB per TPU chip
    assert (shape.cpu, shape.memory_gib) == (96, 128)


def test_the_image_runs_as_the_manifests_user_with_the_benchmarked_versions():
    with open(DOCKERFILE) as f:
        dockerfile = f.read()
    assert re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M).groups() == (str(RUN_AS),) * 2
    assert f"useradd --uid {RUN_AS} --gid {RUN_AS}" in dockerfile
    with open(RESULTS) as f:  # the versions the H100 figures were measured with
        jax, cuda, flax = re.search(r"jax (\S+) and jaxlib \S+ \(CUDA (\d+) plugin\), flax (\S+),",
                                    f.read()).groups()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.M))
    assert args == {"JAX_EXTRA": f"cuda{cuda}", "JAX_VERSION": jax, "FLAX_VERSION": flax}
    install = re.search(r"^RUN pip install (.*?)&&", dockerfile, re.M | re.S).group(1)
    assert {'"jax[${JAX_EXTRA}]==${JAX_VERSION}"', '"jaxlib==${JAX_VERSION}"',
            '"flax==${FLAX_VERSION}"'} <= set(install.split())


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
    assert pod["volumes"][0] == {"name": "workdir",
                                 "persistentVolumeClaim": {"claimName": "shared"}}
    assert "--workdir=/workdir/tiny" in pod["containers"][0]["command"]
    assert not any(a.startswith("--config.checkpoint.dir=")  # beside the workdir on the volume
                   for a in pod["containers"][0]["command"])


def test_pods_detect_the_gke_mode_and_agree_on_the_coordinator(gpu_jobset):
    _, pod = job_and_pod(gpu_jobset)
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"] if "value" in e}
    label = next(e for e in pod["containers"][0]["env"] if e["name"] == "JOB_INDEX")
    assert "jobset.sigs.k8s.io/job-index" in label["valueFrom"]["fieldRef"]["fieldPath"]
    # What Kubernetes and JobSet add to pod 1 of job 0.
    spec = detect({**env, "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": "1"})
    assert spec == ClusterSpec("gke", "tiny-workers-0-0.tiny:8476", 2, 1)


def container_env(container, labels, annotations):
    """The container's environment as Kubernetes builds it for a pod with these labels and
    annotations: fieldRefs read from them, `$(NAME)` replaced by a variable defined before it."""
    env = {}
    for entry in container["env"]:
        if "value" in entry:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)",
                                        lambda m: env.get(m.group(1), m.group(0)), entry["value"])
        else:
            kind, key = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]",
                                     entry["valueFrom"]["fieldRef"]["fieldPath"]).groups()
            env[entry["name"]] = (labels if kind == "labels" else annotations)[key]
    return env


def test_every_pod_has_a_slot_of_its_own_that_outlives_it_and_the_jobsets_count(tpu_jobset):
    """The slot (the local tier's folder) is the pod's job and pod index, which a replacement pod
    keeps; every pod of a multi-slice JobSet has its own, and the range's maximum is its count."""
    rjob = tpu_jobset["spec"]["replicatedJobs"][0]
    jobs, pods = rjob["replicas"], rjob["template"]["spec"]["completions"]
    container = rjob["template"]["spec"]["template"]["spec"]["containers"][0]
    slots = set()
    for job in range(jobs):
        for pod in range(pods):
            env = container_env(container, {"jobset.sigs.k8s.io/job-index": str(job)},
                                {"batch.kubernetes.io/job-completion-index": str(pod)})
            assert env["JAXSCALE_MAX_PROCESSES"] == str(jobs * pods)
            slots.add(host_slot(env, 0))
    assert slots == {f"{job}-{pod}" for job in range(jobs) for pod in range(pods)}
    assert jobs * pods > 2


@pytest.mark.slow  # two launch.gke renders, each checking the config's fit (about 11 s)
def test_an_elastic_jobset_tells_every_pod_the_minimum_it_starts_with():
    """Every pod reads the minimum (runtime.distributed); without --min_processes, none does. On 3
    of the 4 pods batch 32 would leave one pod's 8 GPUs idle: a start with 3 runs on 2, one
    spare, which the pods work out from the GPUs each has."""
    jobset = render([*GPU_ARGS, "--nodes=4", "--min_processes=2", "--config.train.batch_size=32"])
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["JAXSCALE_MIN_PROCESSES"] == "2" and env["PROCESSES_IN_JOB"] == "4"
    assert env["JAXSCALE_DEVICES_PER_PROCESS"] == "8"  # a start leaves no pod all idle
    plain = render(GPU_ARGS)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert not {"JAXSCALE_MIN_PROCESSES", "JAXSCALE_DEVICES_PER_PROCESS"} & {
        e["name"] for e in plain["containers"][0]["env"]}


def test_kueue_setup_defines_the_default_queue_and_priority_classes():
    with open(os.path.join(REPO, "deploy", "gke", "kueue.yaml")) as f:
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
    ([*GPU_ARGS, "--bucket=gs://ckpts"], "--bucket='gs://ckpts' must be a bucket name"),
    ([*GPU_ARGS, "--shm_gib=320"], "--shm_gib=320 must be less than the pod's memory request "
                                   "(320 GiB)"),
    ([*GPU_ARGS, "--cpu=0"], "argument --cpu: 0 must be >= 1"),
    ([*GPU_ARGS, "--node_local_dir=ssd/jaxscale"], "--node_local_dir='ssd/jaxscale' must be an "
                                                   "absolute path"),
    # Pods that could never be scheduled: no node pool has such a label, or such a node.
    ([*GPU_ARGS, "--gpu_type=nvidia-h100"], "--gpu_type='nvidia-h100' is not a GKE GPU "
                                            "accelerator; use one of "),
    ([*GPU_ARGS, "--min_processes=3"], "--min_processes=3 is above --nodes=2"),
    ([*TPU_ARGS, "--min_processes=1"], "--min_processes is for GPU node pools"),
    ([*GPU_ARGS, "--gpus_per_node=9"], "--gpus_per_node=9: a nvidia-h100-80gb node has at most "
                                       "8 GPUs"),
    ([*GPU_ARGS, "--gpu_type=nvidia-tesla-t4", "--gpus_per_node=8"],
     "--gpus_per_node=8: a nvidia-tesla-t4 node has at most 4 GPUs"),
])
def test_bad_input_is_one_error_line_and_no_manifest(args, message):
    result = subprocess.run([*RENDER, *args], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
