"""Files and directories below a root, component by component with O_NOFOLLOW
(runtime/storage/confined.py), on real directories: a link anywhere on the way is
refused, never followed; a directory someone else could write is refused; nothing is made
through either."""

import os

import pytest

from runtime.storage import confined
from runtime.storage.confined import Confined


@pytest.fixture
def tree(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "acme" / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "acme" / "sub" / "a.txt").write_text("mine")
    (outside / "secret.txt").write_text("not yours")
    (root / "acme" / "to-outside").symlink_to(outside)
    (root / "acme" / "secret-link.txt").symlink_to(outside / "secret.txt")
    return root, outside


def read(fd: int) -> str:
    try:
        return os.read(fd, 100).decode()
    finally:
        os.close(fd)


def test_a_file_below_the_root_is_opened(tree):
    root, _ = tree
    assert read(confined.open_file(root, "acme/sub/a.txt")) == "mine"


@pytest.mark.parametrize(
    "relative, reason",
    [
        ("acme/secret-link.txt", "link"),
        ("acme/to-outside/secret.txt", "link"),
        ("acme/missing.txt", "missing"),
        ("acme/sub", "not_regular"),
        ("../outside/secret.txt", "unsafe"),
        ("/etc/passwd", "unsafe"),
        ("acme//sub/a.txt", "unsafe"),
        ("acme/./sub/a.txt", "unsafe"),
    ],
)
def test_what_is_not_a_plain_file_below_the_root_is_refused(tree, relative, reason):
    root, _ = tree
    with pytest.raises(Confined) as refused:
        confined.open_file(root, relative)
    assert refused.value.reason == reason
    assert str(root) not in refused.value.message  # the message never names the server's path


def test_directories_are_made_below_the_root_and_never_through_a_link(tree):
    root, outside = tree
    fd = confined.make_dirs(root, "acme/runs/r1")
    os.close(fd)
    assert (root / "acme" / "runs" / "r1").is_dir()
    with pytest.raises(Confined) as refused:
        confined.make_dirs(root, "acme/to-outside/r2")
    assert refused.value.reason == "link"
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]


def test_a_directory_others_may_write_is_not_used(tree):
    root, _ = tree
    (root / "acme").chmod(0o777)
    with pytest.raises(Confined) as refused:
        confined.make_dirs(root, "acme/runs")
    assert refused.value.reason == "foreign"
    assert not (root / "acme" / "runs").exists()
