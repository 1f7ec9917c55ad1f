"""jaxscale: a config-driven JAX/Flax trainer."""
