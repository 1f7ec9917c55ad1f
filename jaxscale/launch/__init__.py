"""Starting jaxscale on several processes: `local` (one machine, simulated CPU devices), `gke`
(JobSet manifests), `check` (a cross-process smoke test), `fit` (will the job fit), and
`supervise` (restarting a run; also `python -m jaxscale.supervise`). The TPU VM script, the Slurm
batch script, the Dockerfile and the Kueue manifest live in the top-level `deploy/` folder;
docs/launch.md walks through each target."""
