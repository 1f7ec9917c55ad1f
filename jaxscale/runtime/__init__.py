"""The processes a run is made of, below the trainer: finding the cluster and joining it
(`distributed`, `rendezvous`, `tpu_host`), the XLA flags set before a backend starts
(`xla_flags`), the run's folder (`workdir`) and its compilation cache (`compilation_cache`), how
every failed read or write is classified (`storage`), and one verdict of start-up checks for
every process (`agreement`)."""
