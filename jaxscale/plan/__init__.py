"""Planning a run without running it: targets (TPU topologies compiled on any host, GPU nodes),
the chip table, candidate layouts, the memory model, the compiled step's memory and collectives,
and the ranking that `python -m jaxscale.plan` and `mesh.auto` use (docs/planning.md)."""
