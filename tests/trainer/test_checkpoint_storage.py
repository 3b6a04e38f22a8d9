"""The trainer's checkpoint storage check (services/trainer/storage.py), on real directories."""

import os
from types import SimpleNamespace

import pytest

from services.trainer import storage
from services.trainer.storage import StorageUnavailable, prepare

FREE = 10**9


def test_local_storage_is_made_and_a_run_that_fits_passes(tmp_path):
    root = tmp_path / "checkpoints"  # the trainer's own: made on first use
    run = root / "acme" / "r1"
    prepare(root, run, needed=1024, absolute=False)
    assert run.is_dir() and run.stat().st_mode & 0o777 == 0o700
    assert list(run.iterdir()) == []  # the probe leaves nothing behind


def test_an_absolute_storage_path_is_never_created(tmp_path):
    root = tmp_path / "mnt" / "ckpt"
    with pytest.raises(StorageUnavailable, match="does not exist"):
        prepare(root, root / "acme" / "r1", needed=0, absolute=True, allowed=(tmp_path / "mnt",))
    assert not root.exists()


def test_an_absolute_storage_path_outside_the_allowed_roots_is_refused(tmp_path):
    # issue 39: any absolute path a manifest named was written to
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(StorageUnavailable, match="not one this trainer allows"):
        prepare(elsewhere, elsewhere / "acme" / "r1", needed=0, absolute=True, allowed=(tmp_path / "ckpt",))
    assert list(elsewhere.iterdir()) == []


def test_a_link_in_the_storage_is_refused_and_nothing_is_made_through_it(tmp_path):
    # issue 39: a local user made <storage>/<account> a link to a root-owned directory, and the
    # trainer created run_*/data_prep, run_*/pretrain inside it (mkdir(parents=True), no link check)
    storage, precious = tmp_path / "ckpt", tmp_path / "precious"
    storage.mkdir()
    precious.mkdir()
    (storage / "acme").symlink_to(precious)
    for absolute, allowed in ((True, (storage,)), (False, ())):
        with pytest.raises(StorageUnavailable, match="link") as refused:
            prepare(storage, storage / "acme" / "r1", needed=0, absolute=absolute, allowed=allowed)
        assert str(refused.value).startswith("checkpoint_storage_unavailable: ")
        assert list(precious.iterdir()) == []


def test_a_directory_someone_else_could_write_is_refused(tmp_path):
    storage = tmp_path / "ckpt"
    (storage / "acme").mkdir(parents=True)
    (storage / "acme").chmod(0o777)  # another user could plant a link inside it
    with pytest.raises(StorageUnavailable, match="not the trainer's"):
        prepare(storage, storage / "acme" / "r1", needed=0, absolute=False)
    assert not (storage / "acme" / "r1").exists()


def test_storage_that_takes_no_file_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")  # refused for root too, unlike a mode bit
    with pytest.raises(StorageUnavailable) as refused:
        prepare(tmp_path, blocker / "acme" / "r1", needed=0, absolute=False)
    assert str(refused.value).startswith("checkpoint_storage_unavailable: ")


@pytest.mark.parametrize(
    "held, over, refused",
    [(0, 0, False), (0, 1, True), (4096, 1, False), (4096, 4097, True)],
)
def test_the_room_needed_counts_what_the_run_holds_already(tmp_path, monkeypatch, held, over, refused):
    # the disk's free bytes fixed (a real disk's move while the suite runs beside this test)
    monkeypatch.setattr(storage.shutil, "disk_usage", lambda _path: SimpleNamespace(free=FREE))
    run = tmp_path / "acme" / "r1"
    run.mkdir(parents=True, mode=0o700)
    (tmp_path / "acme").chmod(0o700)
    if held:
        (run / "step-1").mkdir()
        (run / "step-1" / "shard").write_bytes(b"x" * held)  # a resumed run rotates its own
    needed = FREE + over
    if refused:
        with pytest.raises(StorageUnavailable, match="GB free"):
            prepare(tmp_path, run, needed=needed, absolute=True, allowed=(tmp_path,))
    else:
        prepare(tmp_path, run, needed=needed, absolute=True, allowed=(tmp_path,))


def test_a_storage_directory_another_user_owns_is_refused(tmp_path):
    # found by the review of issue 39: a tenant who owned <root>/own passed the link checks, and
    # after the trainer's check renamed <own>/<account> away and put its own tree there (a planted
    # checkpoint the next stage would load); the chain from the root down must be the trainer's
    root = tmp_path / "ckpt"
    (root / "own").mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory to another user")
    os.chown(root / "own", 65534, 65534)  # nobody's
    with pytest.raises(StorageUnavailable, match="not the trainer's"):
        prepare(root / "own", root / "own" / "acme" / "r1", needed=0, absolute=True, allowed=(root,))
    assert list((root / "own").iterdir()) == []


def test_a_root_others_may_write_is_refused_unless_sticky(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(StorageUnavailable, match="not the trainer's"):
        prepare(root, root / "acme" / "r1", needed=0, absolute=True, allowed=(root,))
    root.chmod(0o1777)  # /tmp's: others cannot rename what is not theirs
    prepare(root, root / "acme" / "r1", needed=0, absolute=True, allowed=(root,))
    assert (root / "acme" / "r1").is_dir()
