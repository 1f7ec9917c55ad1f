"""`python -m jaxscale.supervise`: the name the supervisor is documented and scripted under (docs,
the TPU VM script, users' job files). It lives beside the other launchers, in
jaxscale/launch/supervise.py, which this runs as `__main__`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("jaxscale.launch.supervise", run_name="__main__", alter_sys=True)
