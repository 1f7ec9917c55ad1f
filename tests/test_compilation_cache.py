"""The compilation cache's staging folder: one path per run, never shared by live starts, and
never one that another user could have written executables into (issue 45, item 6). Each test
stages under its own temporary folder (tempfile.tempdir), not the machine's /tmp."""

import os
import tempfile

import pytest

from jaxscale.runtime.compilation_cache import CompilationCache, untrusted_because

OTHER_UID = 4242  # a user id that is not this process's (tests run as root here, or as a user)


@pytest.fixture
def tmp(tmp_path, monkeypatch):
    """The system's temporary folder, as jaxscale sees it, for this test alone."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def well_known_root(tmp) -> str:
    return str(tmp / f"jaxscale_compilation_cache-{os.getuid()}")


def test_staging_is_one_path_per_run_and_never_shared_by_live_starts(tmp, tmp_path):
    """One start after another stages in the same folder (the programs' cache keys hold its
    path); two live at once (two runs sharing a cache folder on one host) get folders of their
    own, in a folder only this user can enter."""
    cache = str(tmp_path / "cache")
    first = CompilationCache(cache)
    staging = first._staging
    assert os.path.dirname(staging) == well_known_root(tmp)
    second = CompilationCache(cache)  # while the first is live
    assert second._staging != staging and os.path.isdir(second._staging)
    second.close()
    first.close()
    assert not os.path.exists(staging)
    again = CompilationCache(cache)
    assert again._staging == staging
    assert os.stat(os.path.dirname(staging)).st_mode & 0o777 == 0o700
    assert os.stat(staging).st_mode & 0o777 == 0o700
    again.close()


def planted(root: str) -> str:
    """The well-known staging root made first, holding an 'executable' (as another user could)."""
    os.mkdir(root, 0o700)
    with open(os.path.join(root, "planted-executable"), "w") as f:
        f.write("not compiled by this user")
    return root


@pytest.mark.parametrize("how", ["another owner", "open to others", "a symbolic link"])
def test_a_staging_root_this_user_cannot_trust_is_left_alone(tmp, tmp_path, how, caplog):
    """Made first by another user (simulated with chown: these tests may run as root), left
    writable by others, or a link to a folder elsewhere: the start stages in a fresh private
    folder of its own, loads nothing from the planted one and changes nothing in it."""
    root = well_known_root(tmp)
    if how == "a symbolic link":
        elsewhere = planted(str(tmp_path / "elsewhere"))
        os.symlink(elsewhere, root)
        planted_in = elsewhere
    else:
        planted_in = planted(root)
        if how == "another owner":
            os.chown(root, OTHER_UID, OTHER_UID)
        else:
            os.chmod(root, 0o777)
    before = sorted(os.listdir(planted_in)), os.lstat(root)

    cache = CompilationCache(str(tmp_path / "cache"))
    staging = cache._staging

    # Inside neither (a path prefix, not a string one: the fresh folder's name may begin with
    # the planted one's, as jaxscale_compilation_cache-0wf6mf8d did once in a full run).
    assert all(os.path.commonpath([staging, folder]) != folder for folder in (root, planted_in))
    assert untrusted_because(staging) is None  # this user's, mode 0700, a real folder
    assert os.listdir(staging) == []
    assert any(root in r.getMessage() and "new private folder" in r.getMessage()
               for r in caplog.records)
    cache.close()
    assert not os.path.exists(staging)
    assert (sorted(os.listdir(planted_in)), os.lstat(root)) == before


def test_untrusted_because_names_each_reason(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o700)
    assert untrusted_because(str(folder)) is None
    os.chmod(folder, 0o750)
    assert "mode is 750" in untrusted_because(str(folder))
    os.chmod(folder, 0o700)
    os.chown(folder, OTHER_UID, OTHER_UID)
    assert f"belongs to user id {OTHER_UID}" in untrusted_because(str(folder))
    (tmp_path / "link").symlink_to(folder)
    assert untrusted_because(str(tmp_path / "link")) == "it is a symbolic link"
    (tmp_path / "file").write_text("")
    assert untrusted_because(str(tmp_path / "file")) == "it is not a folder"


def test_a_link_where_the_lock_goes_is_refused_not_followed(tmp, tmp_path):
    """In a trusted root only this user can make a link; the lock is opened without following
    one all the same, so a link there never makes the start write elsewhere."""
    cache_dir = str(tmp_path / "cache")
    first = CompilationCache(cache_dir)
    lock = first._staging + ".lock"
    first.close()
    target = tmp_path / "target"
    target.write_text("untouched")
    os.remove(lock)
    os.symlink(target, lock)
    with pytest.raises(OSError):
        CompilationCache(cache_dir)
    assert target.read_text() == "untouched"
