"""Starting jaxscale on several processes: `local` (one machine, simulated CPU devices), `gke`
(JobSet manifests), `check` (a cross-process smoke test). TPU VM and Slurm scripts live in the
top-level `launch/` folder; docs/launch.md walks through each target."""
