"""Reading a reviewed manifest from disk (ecc/manifest_file.py) against real files in tmp_path.

The checks are the OpenSSH StrictModes kind: a regular file, not a symlink, owned by the caller or
root, not writable by group or others, under no directory another user can write to (unless it is
sticky, as /tmp is), at most 1 MiB, and the same file from open to the end of the read.
"""

import hashlib
import os
import stat

import pytest

import ecc.manifest_file
from contracts.errors import ErrorCode
from ecc.manifest_file import DEFAULT_MAX_BYTES, ManifestError, read_manifest

CONTENT = b'{"name": "demo", "budget_cap_usd": 1.0}\n'
OTHER_UID = 65534  # "nobody"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")


@pytest.fixture
def base(tmp_path):
    """A private directory (0700) under tmp_path, whose parents must all pass the parent checks."""
    d = tmp_path / "private"
    d.mkdir(mode=0o700)
    return d


def write(path, data=CONTENT, mode=0o600):
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def code_of(path) -> ErrorCode:
    with pytest.raises(ManifestError) as info:
        read_manifest(str(path))
    assert info.value.message  # always a readable reason
    return info.value.code


def test_parents_of_tmp_path_are_acceptable(tmp_path):
    # the premise of every test here: each directory above tmp_path is ours/root's and not
    # writable by others unless sticky (/tmp is drwxrwxrwt)
    directory = str(tmp_path)
    while True:
        st = os.stat(directory)
        sticky = bool(st.st_mode & stat.S_ISVTX)
        assert sticky or not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH), directory
        if os.path.dirname(directory) == directory:
            break
        directory = os.path.dirname(directory)


@pytest.mark.parametrize("mode", [0o600, 0o644, 0o400, 0o444, 0o700], ids=oct)
def test_ok_returns_the_exact_bytes_and_their_sha256(base, mode):
    path = write(base / "m.json", mode=mode)
    data, digest = read_manifest(str(path))
    assert data == CONTENT and digest == hashlib.sha256(CONTENT).hexdigest()


def test_binary_content_is_returned_unchanged(base):
    blob = bytes(range(256)) * 3 + b"\r\n\x00"
    data, digest = read_manifest(str(write(base / "m.json", blob)))
    assert data == blob and digest == hashlib.sha256(blob).hexdigest()


def test_empty_file_is_read(base):
    assert read_manifest(str(write(base / "m.json", b""))) == (b"", hashlib.sha256(b"").hexdigest())


@pytest.mark.parametrize(
    "path", ["m.json", "./m.json", "private/m.json", ""], ids=["bare", "dot", "nested", "empty"]
)
def test_relative_path_is_refused(base, monkeypatch, path):
    write(base / "m.json")
    monkeypatch.chdir(base.parent)
    assert code_of(path) is ErrorCode.manifest_not_absolute


def test_symlink_is_refused(base):
    target = write(base / "real.json")
    link = base / "link.json"
    link.symlink_to(target)
    assert code_of(link) is ErrorCode.manifest_symlink


def test_dangling_symlink_is_refused_as_symlink(base):
    link = base / "link.json"
    link.symlink_to(base / "nowhere.json")
    assert code_of(link) is ErrorCode.manifest_symlink


@pytest.mark.timeout(
    10
)  # a liveness bound: opening a FIFO without O_NONBLOCK would wait for a writer forever
def test_fifo_is_refused_without_hanging(base):
    fifo = base / "m.json"
    os.mkfifo(fifo, 0o600)
    assert code_of(fifo) is ErrorCode.manifest_not_regular


def test_directory_is_refused(base):
    d = base / "m.json"
    d.mkdir(mode=0o700)
    assert code_of(d) is ErrorCode.manifest_not_regular


def test_device_is_refused():
    assert code_of("/dev/null") is ErrorCode.manifest_not_regular


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666, 0o660, 0o622], ids=oct)
def test_group_or_world_writable_file_is_refused(base, mode):
    assert code_of(write(base / "m.json", mode=mode)) is ErrorCode.manifest_unsafe_permissions


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o757], ids=oct)
def test_file_in_a_directory_others_can_write_is_refused(base, mode):
    d = base / "shared"
    d.mkdir()
    os.chmod(d, mode)
    assert code_of(write(d / "m.json")) is ErrorCode.manifest_unsafe_permissions


def test_unsafe_directory_higher_up_is_refused(base):
    top = base / "open"
    top.mkdir()
    os.chmod(top, 0o777)
    inner = top / "a" / "b"
    inner.mkdir(parents=True, mode=0o700)
    assert code_of(write(inner / "m.json")) is ErrorCode.manifest_unsafe_permissions


def test_file_in_a_sticky_world_writable_directory_is_read(base):
    d = base / "sticky"
    d.mkdir()
    os.chmod(d, 0o1777)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o1777
    assert read_manifest(str(write(d / "m.json")))[0] == CONTENT


@as_root
def test_file_owned_by_another_user_is_refused(base):
    path = write(base / "m.json")
    os.chown(path, OTHER_UID, OTHER_UID)
    assert code_of(path) is ErrorCode.manifest_unsafe_permissions


@as_root
def test_directory_owned_by_another_user_is_refused(base):
    d = base / "theirs"
    d.mkdir(mode=0o755)
    path = write(d / "m.json")
    os.chown(d, OTHER_UID, OTHER_UID)
    assert code_of(path) is ErrorCode.manifest_unsafe_permissions


@pytest.mark.parametrize(
    "size, ok",
    [
        (DEFAULT_MAX_BYTES - 1, True),
        (DEFAULT_MAX_BYTES, True),
        (DEFAULT_MAX_BYTES + 1, False),
        (3 * DEFAULT_MAX_BYTES, False),
    ],
    ids=["1MiB-1", "exactly-1MiB", "1MiB+1", "3MiB"],
)
def test_size_cap(base, size, ok):
    blob = b"x" * size
    path = write(base / "m.json", blob)
    if ok:
        data, digest = read_manifest(str(path))
        assert len(data) == size and digest == hashlib.sha256(blob).hexdigest()
    else:
        assert code_of(path) is ErrorCode.manifest_too_large


def test_a_lower_cap_is_honoured(base):
    path = write(base / "m.json", b"x" * 11)
    assert read_manifest(str(path), max_bytes=11)[0] == b"x" * 11
    with pytest.raises(ManifestError) as info:
        read_manifest(str(path), max_bytes=10)
    assert info.value.code is ErrorCode.manifest_too_large


def test_missing_file_is_invalid(base):
    assert code_of(base / "absent.json") is ErrorCode.manifest_invalid


def test_missing_directory_is_invalid(base):
    assert code_of(base / "no" / "such" / "m.json") is ErrorCode.manifest_invalid


# --- the file must stay the same file from open to the end of the read ---


def patch_first_read(monkeypatch, on_first_read):
    """Make the module's os.read run `on_first_read()` on its first call, then read as usual."""
    real_read = os.read
    calls = []

    def read(fd, n):
        if not calls:
            on_first_read()
        calls.append(n)
        return real_read(fd, n)

    monkeypatch.setattr(ecc.manifest_file.os, "read", read)
    return calls


def test_path_swapped_to_another_inode_during_the_read(base, monkeypatch):
    path = write(base / "m.json")
    impostor = write(base / "impostor.json", CONTENT)  # same bytes, so only the inode tells them apart
    calls = patch_first_read(monkeypatch, lambda: os.rename(impostor, path))
    assert code_of(path) is ErrorCode.manifest_changed
    assert calls  # the swap really happened inside the read
    assert path.read_bytes() == CONTENT and not impostor.exists()


def test_path_removed_during_the_read(base, monkeypatch):
    path = write(base / "m.json")
    patch_first_read(monkeypatch, lambda: os.unlink(path))
    assert code_of(path) is ErrorCode.manifest_changed


def test_path_replaced_by_a_symlink_during_the_read(base, monkeypatch):
    path = write(base / "m.json")
    other = write(base / "other.json")

    def swap():
        os.unlink(path)
        os.symlink(other, path)

    patch_first_read(monkeypatch, swap)
    assert code_of(path) is ErrorCode.manifest_changed


def test_file_appended_to_during_the_read(base, monkeypatch):
    path = write(base / "m.json")

    def append():
        with open(path, "ab") as f:
            f.write(b"  ")

    patch_first_read(monkeypatch, append)
    assert code_of(path) is ErrorCode.manifest_changed


def test_an_unpatched_read_calls_os_read_through_the_module(base, monkeypatch):
    # guards the swap tests: they only mean something if read_manifest reads through ecc.manifest_file.os
    path = write(base / "m.json")
    calls = patch_first_read(monkeypatch, lambda: None)
    assert read_manifest(str(path))[0] == CONTENT and len(calls) >= 1


def test_unsafe_directory_reached_through_a_symlinked_parent_is_refused(base):
    open_dir = base / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)  # anyone can rename `real` away and put their own directory there
    real = open_dir / "real"
    real.mkdir(mode=0o700)
    write(real / "m.json")
    link = base / "link"
    link.symlink_to(real)
    assert code_of(real / "m.json") is ErrorCode.manifest_unsafe_permissions  # by its real path: refused
    assert code_of(link / "m.json") is ErrorCode.manifest_unsafe_permissions  # through the symlink: read
