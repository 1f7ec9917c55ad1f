"""Generating text with a trained model (`sampler`); `python -m jaxscale.sample` is its command."""
