"""How long TensorStore, which writes and reads a checkpoint's arrays, retries a request that a
GCS bucket fails (5xx, 429, no answer) before the save or the read fails.

TensorStore's own default is 32 retries with delays doubling up to 32 s: a bucket answering 503
held a save for over 9.5 minutes (measured through tests/fault_proxy.py), while training waited
on it, before the save retry and exit 75 of manager.py could act. Orbax builds the TensorStore
context of every save and restore itself (`get_ts_context`, from module-level defaults) and takes
none from its caller, so the bound is added to those defaults. It is close to gcsfs' own for the
checkpoint's other files (6 tries, about 1 s doubling): a request is given up within about 30 s;
the save then fails on storage, the next save tries again, and the run stops with exit 75 as it
does when a local disk fails."""

from orbax.checkpoint._src.serialization import tensorstore_utils

# TensorStore's context resource for its `gcs` driver (the one Orbax gives gs:// paths).
GCS_REQUEST_RETRIES = {"max_retries": 5, "initial_delay": "1s", "max_delay": "16s"}


def bound_bucket_retries() -> None:
    """Makes every TensorStore context Orbax builds (with OCDBT or without) give a failing GCS
    request up after GCS_REQUEST_RETRIES."""
    for defaults in (tensorstore_utils._BASE_TS_CONTEXT,
                     tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):
        defaults["gcs_request_retries"] = dict(GCS_REQUEST_RETRIES)
