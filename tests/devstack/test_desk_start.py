"""`up --desk`: the desk's port. Two stacks started side by side (the suite's workers) both found
8765 free and one desk died binding it (test_tls in CI); a desk that exits at start is started
again on any free port."""

import pytest

from devstack import stack


def test_a_desk_that_exits_at_start_is_started_again_on_another_free_port(tmp_path, monkeypatch):
    tried: list[int] = []

    def desk_on(port, env, logs, ca):
        tried.append(port)
        if len(tried) == 1:
            raise stack._ExitedAtStart()
        return {"pid": 1, "url": f"http://127.0.0.1:{port}/"}

    monkeypatch.setattr(stack, "_desk_on", desk_on)
    monkeypatch.setattr(stack.infra, "free_port", lambda preferred=None: preferred or 40000 + len(tried))
    assert stack._start_desk({}, tmp_path)["url"] == "http://127.0.0.1:40001/"
    assert tried == [stack.DESK_PORT, 40001]


def test_a_desk_that_never_starts_is_an_error_naming_its_log(tmp_path, monkeypatch):
    def desk_on(port, env, logs, ca):
        raise stack._ExitedAtStart()

    monkeypatch.setattr(stack, "_desk_on", desk_on)
    with pytest.raises(RuntimeError, match=r"desk\.log"):
        stack._start_desk({}, tmp_path)
