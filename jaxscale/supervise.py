"""`python -m jaxscale.supervise`: the name the supervisor is documented and scripted under (docs,
the TPU VM script, users' job files). It lives beside the other launchers, in
jaxscale/launch/supervise.py."""

from jaxscale.launch.supervise import run_as_command

if __name__ == "__main__":
    run_as_command()
