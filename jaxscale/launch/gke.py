"""Renders a JobSet manifest that trains a config on GKE, GPU or TPU node pools:

    python -m jaxscale.launch.gke --config=configs/llama_1b.py --nodes=8 --gpus_per_node=8 \\
        --image=REGION-docker.pkg.dev/PROJECT/REPO/jaxscale:TAG --bucket=BUCKET > job.yaml
    python -m jaxscale.launch.gke --config=... --tpu_accelerator=tpu-v5p-slice \\
        --tpu_topology=4x4x4 --slices=2 --image=... --bucket=BUCKET > job.yaml
    kubectl apply -f job.yaml

The output is JSON, which is YAML too. One pod per node (GPU) or TPU host, each running
`python -m jaxscale.train`; `--config.KEY=VALUE` overrides are passed through. The config is
checked against the cluster shape (devices, hosts, slices; a GPU type and node size GKE has,
`GKE_GPUS`) before anything is printed. On node pools of a GPU jaxscale describes, the train step
is compiled for them here, without a GPU (the `jaxscale[gpu-compile]` extra; --no_compile skips
it), and refused when it needs more memory than JAX's allocator will have on each GPU.

How the manifest maps jaxscale's contract onto Kubernetes:
- Gang scheduling: the Kueue queue label makes Kueue admit the JobSet's pods together or not at all;
  every pod requests CPU and memory (--cpu, --memory_gib) so that Kueue's quotas count them.
- Coordinator: JobSet's DNS hostnames (`<name>-<job>-0-0.<name>`); runtime.distributed's `gke`
  mode derives it and the process id from the env below.
- Exit statuses, as every launcher reads them (docs/launch.md): 42 ("restart me", after a
  checkpoint on preemption) and 75 (a transient failure of storage, the coordinator or a peer):
  the pod is replaced in place without counting as a failure. 2 (a usage error) and 130
  (interrupted): the JobSet fails at once; restarting cannot fix it. Any other failure: the whole
  JobSet restarts from its last checkpoint, at most --max_restarts times.
- Slots: every pod gets JAXSCALE_HOST_SLOT=<job index>-<pod index>, its stable place in the
  JobSet, and JAXSCALE_MAX_PROCESSES, the JobSet's process count (runtime/distributed.py).
- Elastic (--min_processes, GPU node pools): every pod gets JAXSCALE_MIN_PROCESSES; pods still
  Pending at the rendezvous deadline (distributed.init_timeout_s) fail nothing: the pods that came
  start without them when they are at least the minimum (pod 0, the coordinator, among them), with
  the global batch kept (jaxscale/training/elastic.py); fewer exit 75, and the pod is replaced in
  place. A pod that arrives after the others started writes its arrival marker in the checkpoint
  folder and waits; the run saves, restarts and takes it in (runtime/arrivals.py). Pods
  get JAXSCALE_DEVICES_PER_PROCESS: on a count of pods that would leave one pod's GPUs all idle,
  the run starts on the largest count below it that runs, and the other pods wait as spares.
- SIGTERM on preemption gets `--grace_period_s` to save a checkpoint before SIGKILL.
- Checkpoints on a bucket (--bucket) go to gs://BUCKET/NAME/checkpoints through Orbax's own GCS
  path, which commits a checkpoint with a marker file; GCS FUSE, which cannot rename a folder
  atomically, carries only the workdir (metrics, TensorBoard, the compilation cache).
- The local tier of checkpoints (--node_local_dir) is a folder on each node (its local SSD, or a
  RAM disk the node mounts) given to the pod as a hostPath volume: it outlives the pod, which the
  Job replaces after every exit (an emptyDir, memory-backed or not, would go with it).
- Hardening: a non-root user (RUN_AS, the image's USER), no privilege escalation, no
  capabilities, the runtime's default seccomp profile, a read-only root filesystem with a
  writable /tmp (HOME), no service-account token unless --service_account names one, and a
  bounded /dev/shm (--shm_gib).
"""

from __future__ import annotations

import json
import math
import re
import sys

from jaxscale.cli import ArgumentParser, fail
from jaxscale.errors import (
    INTERRUPTED_EXIT_CODE,
    RESTART_EXIT_CODE,
    TRANSIENT_EXIT_CODE,
    USAGE_EXIT_CODE,
)
from jaxscale.launch.cli import check_train_args, nonnegative, positive
from jaxscale.runtime.distributed import (
    DEVICES_PER_PROCESS_VAR,
    GKE_COORDINATOR_PORT,
    HOST_SLOT_VAR,
    MAX_PROCESSES_VAR,
    MIN_PROCESSES_VAR,
)

CONTAINER = "jaxscale"
REPLICATED_JOB = "workers"
WORKDIR_MOUNT = "/workdir"
LOCAL_CHECKPOINTS_MOUNT = "/local-checkpoints"
# The uid and gid the pods run as: deploy/Dockerfile's USER (tests check that the two agree).
RUN_AS = 1000
# GKE's GPU accelerator labels (--gpu_type: a node pool's cloud.google.com/gke-accelerator), each
# with the most GPUs a node of its machine types has (A4X, A4, A3 Ultra, A3 Mega, A3 High, A2
# Ultra, A2, G2, N1) and the GPU's name in GPU targets (jaxscale/plan/targets.py) where the train
# step can be compiled for it. A pod that asks for another label, or for more GPUs, is never
# scheduled.
GKE_GPUS = {
    "nvidia-gb200": (4, ""), "nvidia-b200": (8, ""), "nvidia-h200-141gb": (8, "h200"),
    "nvidia-h100-mega-80gb": (8, "h100"), "nvidia-h100-80gb": (8, "h100"),
    "nvidia-a100-80gb": (8, "a100"), "nvidia-tesla-a100": (16, ""), "nvidia-l4": (8, ""),
    "nvidia-tesla-t4": (4, ""), "nvidia-tesla-v100": (8, ""), "nvidia-tesla-p100": (4, ""),
    "nvidia-tesla-p4": (4, ""),
}
# Requests per GPU or TPU chip where --cpu and --memory_gib are not given: less than the smallest
# host of each kind leaves after Kubernetes' reservations and its daemons (8 GPUs: g2-standard-96
# and a2-highgpu-8g have 96 vCPUs and 384 GB or more; 4 TPU chips: a v5e host has 112 vCPUs and
# 192 GB), so that the pod fits every such node; A3 has 208 vCPUs and 1,872 GB.
DEFAULT_REQUESTS = {"nvidia.com/gpu": (8, 40), "google.com/tpu": (24, 32)}  # (cpu, GiB) each
# gcsfuse refuses to rename a folder unless it has at most this many entries (0 by default):
# a restart from step 0 moves an earlier start's TensorBoard folder aside (runtime/workdir.py).
FUSE_RENAME_DIR_LIMIT = 1000
# NCCL over the node's primary NIC. A3's extra GPU NICs (GPUDirect-TCPX/TCPXO) need GKE
# multi-networking and a receive-datapath sidecar this renderer does not add; see docs/launch.md.
A3_NCCL_ENV = {
    "NCCL_DEBUG": "WARN",  # failures explain themselves in the pod log
    "NCCL_SOCKET_IFNAME": "eth0",  # the pod network; not the unattached GPU NICs
    "NCCL_NVLS_ENABLE": "0",  # A3 (H100 HGX) has no NVLink SHARP switch
}


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="python -m jaxscale.launch.gke",
        description="Print a JobSet manifest (JSON) that trains CONFIG on GKE. Unknown "
                    "--config.KEY=VALUE flags are passed to training as overrides.")
    parser.add_argument("--config", required=True, help="Config file, e.g. configs/tiny.py; the "
                        "same path must exist in the image (its working directory).")
    parser.add_argument("--image", required=True, help="Container image with jaxscale.")
    parser.add_argument("--name", default="jaxscale",
                        help="JobSet name: lowercase letters, digits and '-' (default jaxscale).")
    parser.add_argument("--nodes", type=positive, help="GPU nodes, one pod each.")
    parser.add_argument("--gpus_per_node", type=positive, default=8,
                        help="GPUs each GPU node has and each pod requests (default 8).")
    parser.add_argument("--gpu_type", default="nvidia-h100-80gb",
                        help="Node selector cloud.google.com/gke-accelerator, one of GKE's "
                             "GPU labels (default nvidia-h100-80gb, A3).")
    parser.add_argument("--no_compile", action="store_true",
                        help="Do not compile the train step for the GPUs before rendering "
                             "(default: compile it where JAX's CUDA plugin is installed).")
    parser.add_argument("--tpu_accelerator",
                        help="TPU node pools instead of GPUs: cloud.google.com/"
                             "gke-tpu-accelerator, e.g. tpu-v5p-slice or tpu-v6e-slice.")
    parser.add_argument("--tpu_topology", help="Chips of one TPU slice, e.g. 2x2x2 or 4x4.")
    parser.add_argument("--chips_per_node", type=positive, default=4,
                        help="TPU chips per host (default 4, as on v4/v5p/v6e multi-host "
                             "slices).")
    parser.add_argument("--slices", type=positive, default=1,
                        help="TPU slices, for multi-slice (default 1).")
    storage = parser.add_mutually_exclusive_group(required=True)
    storage.add_argument("--bucket",
                         help="GCS bucket name: checkpoints go to gs://BUCKET/NAME/checkpoints "
                              "through Orbax's GCS path; the workdir is the bucket mounted with "
                              "GCS FUSE.")
    storage.add_argument("--pvc", help="PersistentVolumeClaim (ReadWriteMany) for the workdir and "
                                       "its checkpoints, writable by uid/gid "
                                       f"{RUN_AS}.")
    parser.add_argument("--workdir", help=f"Workdir inside the pod (default "
                                          f"{WORKDIR_MOUNT}/NAME on the bucket or volume).")
    parser.add_argument("--node_local_dir",
                        help="A folder on each node (its local SSD, or a RAM disk) for the local "
                             "tier of checkpoints, mounted at "
                             f"{LOCAL_CHECKPOINTS_MOUNT}; training gets "
                             f"--config.checkpoint.local_dir={LOCAL_CHECKPOINTS_MOUNT}/NAME. It "
                             f"must be writable by uid {RUN_AS} (docs/checkpointing.md).")
    parser.add_argument("--service_account",
                        help="Kubernetes service account the pods run as, with its token mounted, "
                             "e.g. for Workload Identity access to the bucket; without it the "
                             "pods get no token.")
    parser.add_argument("--cpu", type=positive,
                        help="CPU cores each pod requests (default 8 per GPU, 24 per TPU chip).")
    parser.add_argument("--memory_gib", type=positive,
                        help="GiB of memory each pod requests (default 40 per GPU, 32 per TPU "
                             "chip).")
    parser.add_argument("--shm_gib", type=positive, default=32,
                        help="Size limit of the memory-backed /dev/shm, in GiB; it counts against "
                             "the pod's memory (default 32).")
    parser.add_argument("--queue", default="jaxscale",
                        help="Kueue LocalQueue to submit to (default jaxscale).")
    parser.add_argument("--priority_class", default="jaxscale-normal",
                        help="PriorityClass of the pods (default jaxscale-normal).")
    parser.add_argument("--min_processes", type=positive, default=None,
                        help="Elastic, GPU node pools: the fewest pods the run starts with when "
                             "the others are Pending at the rendezvous deadline (default: all).")
    parser.add_argument("--max_restarts", type=nonnegative, default=10,
                        help="JobSet restarts after crashes; preemptions (exit 42) and transient "
                             "failures (75) don't count (default 10).")
    parser.add_argument("--grace_period_s", type=positive, default=300,
                        help="Seconds from SIGTERM to SIGKILL, the time to save a checkpoint on "
                             "preemption (default 300).")
    return parser


def parse_args(argv: list[str]):
    parser = make_parser()
    args, unknown = parser.parse_known_args(argv)
    overrides = [a for a in unknown if a.startswith("--config.")]
    others = [a for a in unknown if a not in overrides]
    if others:
        parser.error(f"unrecognized arguments: {' '.join(others)}")
    return args, overrides


def check_args(args) -> None:
    if not re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", args.name) or len(args.name) > 40:
        # Pod hostnames <name>-workers-<job>-<pod> must stay within 63 characters.
        fail(f"--name={args.name!r} must be lowercase letters, digits and '-', start with a "
             "letter, and be at most 40 characters")
    if args.bucket is not None and not re.fullmatch(r"[a-z0-9][-_.a-z0-9]{1,220}[a-z0-9]",
                                                     args.bucket):
        fail(f"--bucket={args.bucket!r} must be a bucket name such as my-bucket: lowercase "
             "letters, digits, '-', '_' and '.', without gs://")
    if args.node_local_dir is not None and not args.node_local_dir.startswith("/"):
        fail(f"--node_local_dir={args.node_local_dir!r} must be an absolute path on the nodes, "
             "e.g. /mnt/disks/ssd0/jaxscale")
    if args.tpu_accelerator:
        if args.nodes is not None:
            fail("--nodes is for GPUs; on TPUs the hosts follow from --tpu_topology and "
                 "--chips_per_node")
        if args.min_processes is not None:
            fail("--min_processes is for GPU node pools: a TPU slice cannot run without one of "
                 "its hosts (its ICI needs them all)")
        if not args.tpu_topology or not re.fullmatch(r"\d+(x\d+)+", args.tpu_topology):
            fail(f"--tpu_topology={args.tpu_topology!r} must look like 2x2x2 or 4x4")
        chips = math.prod(int(d) for d in args.tpu_topology.split("x"))
        if chips % args.chips_per_node:
            fail(f"--tpu_topology={args.tpu_topology} has {chips} chips, not a multiple of "
                 f"--chips_per_node={args.chips_per_node}")
    else:
        if args.nodes is None:
            fail("pass --nodes=N (GPU nodes), or --tpu_accelerator and --tpu_topology for TPUs")
        if args.slices != 1:
            fail("--slices is for TPUs; GPU nodes are counted with --nodes")
        if args.gpu_type not in GKE_GPUS:
            fail(f"--gpu_type={args.gpu_type!r} is not a GKE GPU accelerator; use one of "
                 f"{', '.join(GKE_GPUS)} (the node pool's cloud.google.com/gke-accelerator "
                 "label): no node would match")
        if args.min_processes is not None and args.min_processes > args.nodes:
            fail(f"--min_processes={args.min_processes} is above --nodes={args.nodes}; pass a "
                 "minimum no larger than the node count")
        most = GKE_GPUS[args.gpu_type][0]
        if args.gpus_per_node > most:
            fail(f"--gpus_per_node={args.gpus_per_node}: a {args.gpu_type} node has at most "
                 f"{most} GPUs, so no node could take the pod; pass --gpus_per_node of 1 to "
                 f"{most}")


class Shape:
    """Pods and devices of the job: `replicas` Jobs (TPU slices) of `pods` pods each."""

    def __init__(self, args):
        if args.tpu_accelerator:
            chips = math.prod(int(d) for d in args.tpu_topology.split("x"))
            self.replicas, self.pods = args.slices, chips // args.chips_per_node
            self.devices_per_pod = args.chips_per_node
            self.resource = "google.com/tpu"
            self.granules = args.slices  # DCN factors span slices
            self.node_selector = {"cloud.google.com/gke-tpu-accelerator": args.tpu_accelerator,
                                  "cloud.google.com/gke-tpu-topology": args.tpu_topology}
        else:
            self.replicas, self.pods = 1, args.nodes
            self.devices_per_pod = args.gpus_per_node
            self.resource = "nvidia.com/gpu"
            self.granules = args.nodes  # DCN factors span hosts
            self.node_selector = {"cloud.google.com/gke-accelerator": args.gpu_type}
        self.devices = self.replicas * self.pods * self.devices_per_pod
        cpu_each, gib_each = DEFAULT_REQUESTS[self.resource]
        self.cpu = args.cpu or cpu_each * self.devices_per_pod
        self.memory_gib = args.memory_gib or gib_each * self.devices_per_pod


def render(args, shape: Shape, overrides: list[str]) -> dict:
    """The JobSet, as a dict ready for JSON."""
    workdir = args.workdir or f"{WORKDIR_MOUNT}/{args.name}"
    train = ["python", "-m", "jaxscale.train", f"--config={args.config}", f"--workdir={workdir}",
             *training_overrides(args, overrides)]
    env = {
        # What runtime.distributed's gke mode reads (JOB_COMPLETION_INDEX comes from Kubernetes).
        "JOBSET_NAME": args.name,
        "REPLICATED_JOB_NAME": REPLICATED_JOB,
        "REPLICATED_JOB_REPLICAS": str(shape.replicas),
        "PROCESSES_IN_JOB": str(shape.pods),
        "JAX_COORDINATOR_PORT": str(GKE_COORDINATOR_PORT),
        # The root filesystem is read-only: JAX, XLA and CUDA keep their caches under HOME.
        "HOME": "/tmp",
        **({} if args.tpu_accelerator else A3_NCCL_ENV),
        # The count the config is written for, whatever count a start has (training/elastic.py).
        MAX_PROCESSES_VAR: str(shape.replicas * shape.pods),
        **({} if args.min_processes is None
           else {MIN_PROCESSES_VAR: str(args.min_processes)}),
        # A range's start leaves no pod all idle (runtime/rendezvous.py's spares).
        **({} if args.min_processes is None
           else {DEVICES_PER_PROCESS_VAR: str(shape.devices_per_pod)}),
    }
    container = {
        "name": CONTAINER,
        "image": args.image,
        "command": train,
        "env": [{"name": k, "value": v} for k, v in env.items()] + [
            {"name": "JOB_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.labels['jobset.sigs.k8s.io/job-index']"}}},
            # The pod's place in the JobSet, which a replacement pod keeps while an elastic start
            # renumbers the processes: the folder of its local checkpoints. Kubernetes adds
            # JOB_COMPLETION_INDEX after these, too late for $(...) to read it.
            {"name": "POD_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
            {"name": HOST_SLOT_VAR, "value": "$(JOB_INDEX)-$(POD_INDEX)"}],
        "ports": [{"containerPort": GKE_COORDINATOR_PORT, "name": "coordinator"}],
        # CPU and memory: requests only. Kueue's quotas and the scheduler count them, and they
        # keep the pod out of the BestEffort class that is evicted first; a CPU limit would
        # throttle the input pipeline and a memory limit would OOM-kill a save's peak.
        "resources": {"requests": {"cpu": str(shape.cpu), "memory": f"{shape.memory_gib}Gi"},
                      "limits": {shape.resource: str(shape.devices_per_pod)}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
        "volumeMounts": [
            {"name": "workdir", "mountPath": WORKDIR_MOUNT},
            # NCCL and the data loader's workers share memory through /dev/shm, which is 64 MiB
            # in a container by default.
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    volumes = [
        workdir_volume(args),
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{args.shm_gib}Gi"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if args.node_local_dir:
        # The node's own folder: what the pod that replaces this one on the node reads back.
        volumes.append({"name": "local-checkpoints", "hostPath": {
            "path": args.node_local_dir, "type": "DirectoryOrCreate"}})
        container["volumeMounts"].append({"name": "local-checkpoints",
                                          "mountPath": LOCAL_CHECKPOINTS_MOUNT})
    pod_spec = {
        "restartPolicy": "Never",  # the Job replaces failed pods; required by podFailurePolicy
        "terminationGracePeriodSeconds": args.grace_period_s,
        "priorityClassName": args.priority_class,
        "nodeSelector": shape.node_selector,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS,
            "runAsGroup": RUN_AS,
            "fsGroup": RUN_AS,  # a volume that honours it is writable by the run
            # Only when the volume's root is not the group's yet: not a walk over every
            # checkpoint file at each pod start.
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        # No Kubernetes API token in the pods unless a service account is asked for (Workload
        # Identity reads the bucket as that account).
        "automountServiceAccountToken": bool(args.service_account),
        "containers": [container],
        "volumes": volumes,
    }
    if args.service_account:
        pod_spec["serviceAccountName"] = args.service_account
    pod_annotations = {"gke-gcsfuse/volumes": "true"} if args.bucket else {}
    job_spec = {
        "completionMode": "Indexed",
        "completions": shape.pods,
        "parallelism": shape.pods,
        "backoffLimit": 0,  # a gang cannot go on without a member: any failure fails the Job
        # The first rule that matches decides; a failure no rule matches counts against
        # backoffLimit, which fails the Job and restarts the JobSet (counted in maxRestarts).
        # Kubernetes wants the values sorted.
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onExitCodes": {
                "containerName": CONTAINER, "operator": "In",
                "values": [USAGE_EXIT_CODE, INTERRUPTED_EXIT_CODE]}},
            {"action": "Ignore", "onExitCodes": {
                "containerName": CONTAINER, "operator": "In",
                "values": [RESTART_EXIT_CODE, TRANSIENT_EXIT_CODE]}},
            # Evicted or preempted by Kubernetes (node drain, spot reclaim): not our failure.
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget",
                                                      "status": "True"}]},
        ]},
        "template": {"metadata": {"annotations": pod_annotations}, "spec": pod_spec},
    }
    metadata = {"name": args.name, "labels": {"kueue.x-k8s.io/queue-name": args.queue}}
    if shape.replicas > 1:
        # One slice per node pool, so that a slice's hosts share its ICI.
        metadata["annotations"] = {
            "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": {
                "maxRestarts": args.max_restarts,
                "rules": [{
                    # Only the FailJob rule above (2, 130) fails a Job by its pod failure policy.
                    "name": "FailOnUsageErrorOrInterrupt", "action": "FailJobSet",
                    "onJobFailureReasons": ["PodFailurePolicy"]}],
            },
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": shape.replicas,
                "template": {"spec": job_spec},
            }],
        },
    }


def training_overrides(args, overrides: list[str]) -> list[str]:
    """The `--config.` flags training gets: where the manifest puts the checkpoints, unless the
    user's `overrides` (which follow) say otherwise."""
    given = {o.split("=", 1)[0] for o in overrides}
    added = []
    if args.bucket and "--config.checkpoint.dir" not in given:
        # Orbax writes gs:// itself (TensorStore for arrays, gcsfs for the rest) and commits each
        # checkpoint with a commit_success.txt marker: no folder rename, which FUSE cannot do
        # atomically. With the default workdir, beside its files, as <workdir>/checkpoints.
        added.append(f"--config.checkpoint.dir=gs://{args.bucket}/{args.name}/checkpoints")
    if args.node_local_dir and "--config.checkpoint.local_dir" not in given:
        added.append(f"--config.checkpoint.local_dir={LOCAL_CHECKPOINTS_MOUNT}/{args.name}")
    return added + overrides


def workdir_volume(args) -> dict:
    if args.bucket:
        # uid/gid: the files belong to the pod's user, who may then write them.
        options = (f"implicit-dirs,uid={RUN_AS},gid={RUN_AS},"
                   f"rename-dir-limit={FUSE_RENAME_DIR_LIMIT}")
        return {"name": "workdir", "csi": {
            "driver": "gcsfuse.csi.storage.gke.io",
            "volumeAttributes": {"bucketName": args.bucket, "mountOptions": options}}}
    return {"name": "workdir", "persistentVolumeClaim": {"claimName": args.pvc}}


def main(argv: list[str]) -> None:
    args, overrides = parse_args(argv)
    check_args(args)
    shape = Shape(args)
    if args.shm_gib >= shape.memory_gib:
        fail(f"--shm_gib={args.shm_gib} must be less than the pod's memory request "
             f"({shape.memory_gib} GiB): /dev/shm is memory the pod uses; pass a smaller "
             "--shm_gib or a larger --memory_gib")
    gpu = "" if args.tpu_accelerator or args.no_compile else GKE_GPUS[args.gpu_type][1]
    check_train_args([f"--config={args.config}", *training_overrides(args, overrides)],
                     shape.devices, shape.granules, gpu,
                     # The pods know their devices: a count below that is a spare's.
                     fewer_devices=() if args.min_processes is None
                     else (args.min_processes * shape.devices_per_pod,))
    json.dump(render(args, shape, overrides), sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main(sys.argv[1:])
