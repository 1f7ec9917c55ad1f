"""Renders a JobSet manifest that trains a config on GKE, GPU or TPU node pools:

    python -m jaxscale.launch.gke --config=configs/llama_1b.py --nodes=8 --gpus_per_node=8 \\
        --image=REGION-docker.pkg.dev/PROJECT/REPO/jaxscale:TAG --bucket=BUCKET > job.yaml
    python -m jaxscale.launch.gke --config=... --tpu_accelerator=tpu-v5p-slice \\
        --tpu_topology=4x4x4 --slices=2 --image=... --bucket=BUCKET > job.yaml
    kubectl apply -f job.yaml

The output is JSON, which is YAML too. One pod per node (GPU) or TPU host, each running
`python -m jaxscale.train`; `--config.KEY=VALUE` overrides are passed through. The config is
checked against the cluster shape (devices, hosts, slices) before anything is printed.

How the manifest maps jaxscale's contract onto Kubernetes:
- Gang scheduling: the Kueue queue label makes Kueue admit the JobSet's pods together or not at all.
- Coordinator: JobSet's DNS hostnames (`<name>-<job>-0-0.<name>`); jaxscale.distributed's `gke`
  mode derives it and the process id from the env below.
- Exit status 42 ("restart me", after a checkpoint on preemption): the pod is replaced in place
  without counting as a failure (every process exits 42 at the same agreed step).
  Exit status 2 (a usage error): the JobSet fails at once; restarting cannot fix it.
  Any other failure: the whole JobSet restarts from its last checkpoint, at most --max_restarts.
- SIGTERM on preemption gets `--grace_period_s` to save a checkpoint before SIGKILL.
"""

from __future__ import annotations

import json
import math
import re
import sys

from jaxscale.distributed import GKE_COORDINATOR_PORT
from jaxscale.errors import RESTART_EXIT_CODE, USAGE_EXIT_CODE
from jaxscale.cli import fail
from jaxscale.launch.cli import ArgumentParser, check_train_args, nonnegative, positive

CONTAINER = "jaxscale"
REPLICATED_JOB = "workers"
CHECKPOINT_MOUNT = "/checkpoints"
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
                        help="Node selector cloud.google.com/gke-accelerator (default "
                             "nvidia-h100-80gb, A3).")
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
    storage.add_argument("--bucket", help="GCS bucket for the workdir, mounted with GCS FUSE.")
    storage.add_argument("--pvc", help="PersistentVolumeClaim (ReadWriteMany) for the workdir.")
    parser.add_argument("--workdir", help=f"Workdir inside the pod (default "
                                          f"{CHECKPOINT_MOUNT}/NAME on the bucket or volume).")
    parser.add_argument("--service_account",
                        help="Kubernetes service account, e.g. for Workload Identity access to "
                             "the bucket.")
    parser.add_argument("--queue", default="jaxscale",
                        help="Kueue LocalQueue to submit to (default jaxscale).")
    parser.add_argument("--priority_class", default="jaxscale-normal",
                        help="PriorityClass of the pods (default jaxscale-normal).")
    parser.add_argument("--max_restarts", type=nonnegative, default=10,
                        help="JobSet restarts after failures; preemptions (exit 42) don't count "
                             "(default 10).")
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
    if args.tpu_accelerator:
        if args.nodes is not None:
            fail("--nodes is for GPUs; on TPUs the hosts follow from --tpu_topology and "
                 "--chips_per_node")
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


def render(args, shape: Shape, overrides: list[str]) -> dict:
    """The JobSet, as a dict ready for JSON."""
    workdir = args.workdir or f"{CHECKPOINT_MOUNT}/{args.name}"
    train = ["python", "-m", "jaxscale.train", f"--config={args.config}", f"--workdir={workdir}",
             *overrides]
    env = {
        # What jaxscale.distributed's gke mode reads (JOB_COMPLETION_INDEX comes from Kubernetes).
        "JOBSET_NAME": args.name,
        "REPLICATED_JOB_NAME": REPLICATED_JOB,
        "REPLICATED_JOB_REPLICAS": str(shape.replicas),
        "PROCESSES_IN_JOB": str(shape.pods),
        "JAX_COORDINATOR_PORT": str(GKE_COORDINATOR_PORT),
        **({} if args.tpu_accelerator else A3_NCCL_ENV),
    }
    container = {
        "name": CONTAINER,
        "image": args.image,
        "command": train,
        "env": [{"name": k, "value": v} for k, v in env.items()] + [
            {"name": "JOB_INDEX", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.labels['jobset.sigs.k8s.io/job-index']"}}}],
        "ports": [{"containerPort": GKE_COORDINATOR_PORT, "name": "coordinator"},
                  {"containerPort": GKE_COORDINATOR_PORT + 1, "name": "rendezvous"}],
        "resources": {"limits": {shape.resource: str(shape.devices_per_pod)}},
        "volumeMounts": [{"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT}],
    }
    volumes = [checkpoint_volume(args)]
    if not args.tpu_accelerator:
        # NCCL and the data loader share memory between processes through /dev/shm, which is
        # 64 MiB in a container by default.
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    pod_spec = {
        "restartPolicy": "Never",  # the Job replaces failed pods; required by podFailurePolicy
        "terminationGracePeriodSeconds": args.grace_period_s,
        "priorityClassName": args.priority_class,
        "nodeSelector": shape.node_selector,
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
        "podFailurePolicy": {"rules": [
            {"action": "Ignore", "onExitCodes": {
                "containerName": CONTAINER, "operator": "In", "values": [RESTART_EXIT_CODE]}},
            {"action": "FailJob", "onExitCodes": {
                "containerName": CONTAINER, "operator": "In", "values": [USAGE_EXIT_CODE]}},
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
                    # Only exit status 2 fails a Job through its pod failure policy.
                    "name": "FailOnUsageError", "action": "FailJobSet",
                    "onJobFailureReasons": ["PodFailurePolicy"]}],
            },
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": shape.replicas,
                "template": {"spec": job_spec},
            }],
        },
    }


def checkpoint_volume(args) -> dict:
    if args.bucket:
        return {"name": "checkpoints", "csi": {
            "driver": "gcsfuse.csi.storage.gke.io",
            "volumeAttributes": {"bucketName": args.bucket, "mountOptions": "implicit-dirs"}}}
    return {"name": "checkpoints", "persistentVolumeClaim": {"claimName": args.pvc}}


def main(argv: list[str]) -> None:
    args, overrides = parse_args(argv)
    check_args(args)
    shape = Shape(args)
    check_train_args([f"--config={args.config}", *overrides], shape.devices, shape.granules)
    json.dump(render(args, shape, overrides), sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main(sys.argv[1:])
