"""How a failed read or write is classified, the same way wherever it happens: the workdir, the
checkpoints (read and written), data sources, weights files, trackers' folders.

* the storage refused this process (`access_denied`: a permission, a read-only mount, a bucket
  the account has no rights on): the user's to resolve, exit 2 (ConfigError), never retried;
* a path that cannot be what it should (missing, a file where a folder belongs, a name too long,
  a loop of links): the user's too, exit 2 with the fix;
* anything else the operating system or a storage client reports (EIO, ENOSPC, EDQUOT, a
  timeout, a stale handle): the storage failing for now, exit 75 (TransientError), retried with
  backoff by the launcher.

Bytes that were read and do not parse are none of these: the reader that parses them says what
they prove (a malformed record, a damaged checkpoint).
"""

from __future__ import annotations

import contextlib
import errno
import os

import fsspec

from jaxscale.errors import ConfigError, TransientError

# The extra that installs the libraries fsspec opens bucket URLs (gs://, s3://) with.
CLOUD_EXTRA = "pip install 'jaxscale[cloud]'"


def _http_error() -> tuple[type[Exception], ...]:
    """gcsfs' error for an HTTP status it has no OSError for (5xx and 429 once its retries are
    spent, 401): no OSError, with the status as `code` (seen from a server answering 503)."""
    try:
        from gcsfs.retry import HttpError
    except ImportError:  # no gcsfs
        return ()
    return (HttpError,)


def _unreachable_errors() -> tuple[type[Exception], ...]:
    """What a bucket's library raises when its server cannot be reached and that is no OSError
    (gcsfs' aiohttp errors are OSErrors): botocore's connection errors, under s3fs."""
    try:
        from botocore.exceptions import ConnectionError as EndpointUnreachable
    except ImportError:  # no s3fs: no botocore
        return ()
    return (EndpointUnreachable,)


_GRANT = ("grant that account access to the bucket (GCS: roles/storage.objectUser; S3: "
          "s3:ListBucket, s3:GetObject, s3:PutObject, s3:DeleteObject; see docs/launch.md), or "
          "run with credentials that have it")


def check_bucket(path: str, key: str) -> None:
    """Asks the server for the bucket of `path` (config key `key`) before anything is read or
    written: ConfigError naming it when it does not exist (or the account cannot see it),
    TransientError when the server cannot be reached (after the library's own retries)."""
    fs, inner = filesystem(path, key)
    bucket = inner.split("/", 1)[0]
    url = fs.unstrip_protocol(bucket)
    try:
        fs.info(bucket)
    except FileNotFoundError as e:  # what gcsfs and s3fs raise for a bucket not there
        raise ConfigError(f"{key}={path!r}: bucket {url} does not exist, or this account cannot "
                          "see it; create it, or fix the path") from e
    except OSError as e:
        if access_denied(e):
            raise ConfigError(f"{key}={path!r}: bucket {url} refused {account(fs)} "
                              f"({reason(e)}); {_GRANT}") from e
        raise storage_error(e, f"{key}={path!r}: bucket {url} cannot be reached ({reason(e)})",
                            "fix the path") from e
    except library_errors() as e:  # gcsfs' 5xx/429 once retried, 401; botocore's no answer
        if library_refused(e):
            raise ConfigError(f"{key}={path!r}: bucket {url} refused {account(fs)} "
                              f"({' '.join(str(e).split())}); {_GRANT}") from e
        raise library_error(e, f"{key}={path!r}: bucket {url} cannot be reached",
                            "fix the path") from e


def account(fs: fsspec.AbstractFileSystem) -> str:
    """Who the bucket's library asked as, in words, as far as it can tell: the AWS access key
    s3fs signed with, the Google service account gcsfs presented, else what is known."""
    protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
    if "s3" in protocols:
        import botocore.session  # s3fs is installed, so botocore is

        # s3fs takes its credentials from botocore's chain (variables, ~/.aws, the instance's
        # role) when given none, as jaxscale's filesystems are.
        credentials = botocore.session.Session().get_credentials()
        return (f"AWS access key {credentials.access_key}" if credentials
                else "a request without AWS credentials")
    google = getattr(getattr(fs, "credentials", None), "credentials", None)
    email = getattr(google, "service_account_email", None)
    if email and email != "default":  # "default": the metadata server's, not yet asked
        return f"service account {email}"
    if google is not None:
        return "the Google Application Default Credentials' account"
    return "a request without Google credentials"


def library_errors() -> tuple[type[Exception], ...]:
    """What the buckets' libraries raise for a failed request that is no OSError (an OSError
    goes to `storage_error`): gcsfs' HttpError, botocore's connection errors."""
    return (*_http_error(), *_unreachable_errors())


def library_refused(error: Exception) -> bool:
    """Whether `error`, one of `library_errors()`, is the server refusing this process (HTTP 401
    or 403): the user's to resolve; any other is the storage failing for now."""
    return getattr(error, "code", None) in (401, 403)


def library_error(error: Exception, what: str, fix: str) -> ConfigError | TransientError:
    """What to raise when a request for `what` failed with one of `library_errors()`: a refusal
    (HTTP 401/403) is the user's to resolve, anything else (5xx, 429 once retried, no answer)
    the storage failing for now."""
    words = " ".join(str(error).split())
    if library_refused(error):
        return ConfigError(f"{what} ({words}); {grant_or(fix)}")
    return TransientError(f"{what} ({words}): the storage is failing")


def in_bucket(path: str) -> bool:
    """Whether `path` is a URL (gs://, s3://) rather than a local path."""
    return "://" in path


def filesystem(path: str, key: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(the filesystem that holds `path`, the path within it): a local disk or a bucket, one
    layer for both. `key` is the config key or flag that gave `path`; when the bucket's library
    (gcsfs, s3fs) is missing, a ConfigError says which extra installs it."""
    try:
        return fsspec.core.url_to_fs(path)
    except ImportError as e:
        # fsspec's own words name the library ("Please install gcsfs to access Google Storage").
        raise ConfigError(f"{key}={path!r} is in a bucket, whose library is not installed "
                          f"({e}): {CLOUD_EXTRA}") from e

# Errors only the user can resolve besides a refusal (`access_denied`): a folder that cannot
# hold files (/proc), a file where a folder belongs, a bad name, a missing file. Any other (EIO,
# ENOSPC, EDQUOT, a timeout) is the storage failing for now.
_USER_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EEXIST,
                          errno.ENAMETOOLONG, errno.ELOOP})
# A refusal: no retry grants a permission or makes a read-only mount writable.
_DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
# gcsfs raises HTTP 403 as an OSError without errno whose words start "Forbidden: " (its
# retry.validate_response: no type of its own; seen from a server answering 403 in
# tests/test_buckets.py); s3fs raises PermissionError (seen from moto refusing an access key).
_DENIED_HTTP_WORDS = ("Forbidden", "Unauthorized")
# TensorStore raises a ValueError whose words start with its absl status code.
_DENIED_STATUSES = ("PERMISSION_DENIED: ", "UNAUTHENTICATED: ")


def access_denied(error: BaseException) -> bool:
    """Whether `error` is the storage refusing this process (a permission, a read-only mount, a
    bucket the account has no rights on): the user's to resolve, never retried."""
    if isinstance(error, OSError):
        if isinstance(error, PermissionError) or error.errno in _DENIED_ERRNOS:
            return True
        return error.errno is None and str(error).startswith(_DENIED_HTTP_WORDS)
    return isinstance(error, ValueError) and str(error).startswith(_DENIED_STATUSES)


# No room left: the storage failing too, but one a person may have to resolve (free space).
_NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# TensorStore reports them in its own words, without the errno.
_NO_SPACE_WORDS = tuple(os.strerror(number) for number in sorted(_NO_SPACE_ERRNOS))


def no_space(error: BaseException) -> bool:
    """Whether `error` says the storage has no room left (ENOSPC, EDQUOT, or TensorStore's
    words for them)."""
    return (getattr(error, "errno", None) in _NO_SPACE_ERRNOS
            or any(words in str(error) for words in _NO_SPACE_WORDS))


def grant_or(fix: str) -> str:
    """The fix for a refusal: access for this process's account, or what else `fix` says."""
    return f"access was denied: grant this process's user (or service account) access, or {fix}"


def reason(error: OSError) -> str:
    """Why `error` failed, on one line: its errno's words, else its text (gcsfs' spans lines)."""
    return error.strerror or " ".join(str(error).split())


def storage_error(error: OSError, what: str, fix: str) -> ConfigError | TransientError:
    """The error to raise when `error` made `what` fail (`what` names the path and the reason): a
    ConfigError ending in `fix` (or, for a refusal, in granting access) when the user must change
    something, else a TransientError (exit 75: retried with backoff)."""
    if access_denied(error):
        return ConfigError(f"{what}; {grant_or(fix)}")
    # gcsfs and s3fs raise FileNotFoundError without an errno (an object or bucket not there).
    if error.errno in _USER_ERRNOS or isinstance(error, FileNotFoundError):
        return ConfigError(f"{what}; {fix}")
    return TransientError(f"{what}: the storage is failing")


@contextlib.contextmanager
def writing(path: str, fix: str):
    """Raises what `storage_error` makes of an OSError from the block, which writes `path` (or
    the file the OSError names): the run's own files are classified as its checkpoints are."""
    try:
        yield
    except OSError as e:
        raise storage_error(e, f"cannot write {e.filename or path!r} ({reason(e)})", fix) from e


@contextlib.contextmanager
def classified(what: str, fix: str):
    """Raises what the storage failing in the block means for the run: an OSError as
    `storage_error` makes it, a bucket library's own error (gcsfs' 5xx once retried, which is
    no OSError) as `library_error` does. `what` says what the block did: "cannot read 'gs://...'".
    """
    try:
        yield
    except OSError as e:
        raise storage_error(e, f"{what} ({reason(e)})", fix) from e
    except library_errors() as e:
        raise library_error(e, what, fix) from e
