"""A run's persistent compilation cache, staged in a private folder until the run may write.

The train step compiles before the run's start-up checks have all passed, and a start that stops
there must leave the workdir as it was. So until `CompilationCache.open()`, JAX's cache is a
staging folder under the system's temporary folder, which reads the programs of the run's cache
folder (through links) and takes the new ones; `open()` moves the new ones in.

JAX loads whatever executables it finds in its cache folder, so the staging folder must be this
user's alone: `<tmp>/jaxscale_compilation_cache-<uid>` is used only when it is a real folder (not
a link), owned by this user, that no one else may enter (mode 0700); one that another user made
first (on a shared login node, anyone may create that name) is left alone, and this start stages
in a fresh private folder instead (it compiles again, but loads nothing it did not compile).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import stat
import tempfile

import jax
import ml_collections
from jax.experimental.compilation_cache import compilation_cache

from jaxscale.runtime.storage import writing

_log = logging.getLogger(__name__)
# The fix for a cache folder the storage refuses.
CACHE_FIX = ("pass --config.checkpoint.compilation_cache_dir=<a folder you can write>, or "
             "--config.checkpoint.compilation_cache=False")


def compilation_cache_dir(config: ml_collections.ConfigDict, workdir: str) -> str | None:
    """The run's cache folder (checkpoint.compilation_cache_dir, else <workdir>/
    compilation_cache); None when checkpoint.compilation_cache is off."""
    c = config.checkpoint
    if not c.compilation_cache:
        return None
    return c.compilation_cache_dir or os.path.join(workdir, "compilation_cache")


# JAX reports each program it loads from the persistent cache as this event (jax.monitoring).
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_loaded = 0  # programs this process has loaded from the cache, counted by `_count_loads`


def _count_loads(event: str, **_metadata) -> None:
    global _loaded
    if event == _CACHE_HIT:
        _loaded += 1


jax.monitoring.register_event_listener(_count_loads)


def programs_loaded() -> int:
    """How many compiled programs this process has loaded from the persistent cache so far:
    a start whose count grew while it compiled its train step compiled nothing."""
    return _loaded


def use_compilation_cache(cache_dir: str | None) -> None:
    """Points JAX's persistent compilation cache at `cache_dir` (None turns it off): a restarted
    run loads its compiled programs instead of compiling them again."""
    compilation_cache.set_cache_dir(cache_dir)
    # No XLA cache of its own beside it (GPU autotuning results, by default): JAX puts that
    # cache's path, which holds this process's staging folder, into the programs' cache keys,
    # and only process 0 writes programs, so the others' keys would never be found: they would
    # compile at every restart while process 0 loads.
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    # JAX opens the cache once per process; reopen it in case an earlier run here used another.
    compilation_cache.reset_cache()


def untrusted_because(path: str) -> str | None:
    """Why the folder `path` may not hold executables this process loads (None: it may): it is a
    link, not a folder, another user's, or open to others. Looks at `path` itself, never through
    a link."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    if info.st_uid != os.getuid():
        return f"it belongs to user id {info.st_uid}, not this user ({os.getuid()})"
    if info.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(info.st_mode):o}: other users may write or read it"
    return None


def private_root() -> tuple[str, bool]:
    """(the folder staging folders are made in, whether it is the shared well-known one): this
    user's `<tmp>/jaxscale_compilation_cache-<uid>`, made 0700 if missing; when it exists and
    cannot be trusted (`untrusted_because`), a new private folder of `mkdtemp`'s instead."""
    root = os.path.join(tempfile.gettempdir(), f"jaxscale_compilation_cache-{os.getuid()}")
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    problem = untrusted_because(root)
    if problem is None:
        return root, True
    _log.warning("compiled programs are staged in a new private folder, not in %s: %s (remove "
                 "it to let restarts load their programs from the compilation cache)", root,
                 problem)
    return tempfile.mkdtemp(prefix="jaxscale_compilation_cache-"), False


class CompilationCache:
    """The persistent compilation cache of a run (`cache_dir`; None: off), on from the train
    step's compile, which comes before the run may write: until `open()`, JAX's cache is a
    private staging folder that reads the programs in `cache_dir` (through links) and takes the
    new ones; `open()`, once the run writes, moves the new ones into `cache_dir`. A start that
    stops before writing leaves `cache_dir` as it was, or not made.

    The staging folder's path is the same at every start of the run (per cache folder, process
    and user); since the XLA caches that put it into the programs' cache keys are off
    (`use_compilation_cache`), the keys are the same on every process and at every start either
    way. A lock keeps two live starts from sharing it; the second takes a folder of its own."""

    def __init__(self, cache_dir: str | None, process_index: int = 0):
        self.cache_dir = cache_dir
        self._staging = self._lock = None
        if cache_dir:
            self._staging = self._claim_staging(cache_dir, process_index)
            if os.path.isdir(cache_dir):  # a restart reads the programs compiled before
                for name in os.listdir(cache_dir):
                    os.symlink(os.path.abspath(os.path.join(cache_dir, name)),
                               os.path.join(self._staging, name))
        use_compilation_cache(self._staging)

    def open(self) -> None:
        """The run writes from here on: the cache is `cache_dir`, with what was compiled since."""
        if self._staging:
            with writing(self.cache_dir, CACHE_FIX):
                os.makedirs(self.cache_dir, exist_ok=True)
                for entry in os.scandir(self._staging):
                    if not entry.is_symlink():
                        shutil.move(entry.path, os.path.join(self.cache_dir, entry.name))
            use_compilation_cache(self.cache_dir)
            self._remove_staging()

    def close(self) -> None:
        """A start that stopped before writing keeps nothing, and leaves the cache off."""
        if self._staging:
            use_compilation_cache(None)
            self._remove_staging()

    def _claim_staging(self, cache_dir: str, process_index: int) -> str:
        """This run's staging folder, empty and locked, in a folder of this user's only."""
        root, shared = private_root()
        if not shared:  # a fresh folder of this start's own: nothing to share or lock
            return root
        run = hashlib.sha256(os.path.abspath(cache_dir).encode()).hexdigest()[:16]
        staging = os.path.join(root, f"{run}-{process_index}")
        # No other user can enter `root`; O_NOFOLLOW all the same, so a link there is refused.
        fd = os.open(staging + ".lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        self._lock = os.fdopen(fd, "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another start of this cache folder is compiling right now
            self._lock.close()
            self._lock = None
            return tempfile.mkdtemp(dir=root)
        if os.path.islink(staging):  # rmtree refuses a link: remove the link itself
            os.remove(staging)
        shutil.rmtree(staging, ignore_errors=True)  # left by a start that crashed
        os.mkdir(staging, 0o700)
        return staging

    def _remove_staging(self) -> None:
        shutil.rmtree(self._staging, ignore_errors=True)
        self._staging = None
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None
