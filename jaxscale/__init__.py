"""jaxscale: a config-driven JAX/Flax trainer.

    jaxscale.Trainer(config, workdir).run()
"""


def __getattr__(name):
    # Lazy, so `import jaxscale` (and `python -m jaxscale.train --help`) does not import JAX.
    if name == "Trainer":
        from jaxscale.trainer import Trainer
        return Trainer
    raise AttributeError(f"module 'jaxscale' has no attribute {name!r}")
