"""The one bounded wait the suite shares: it returns what it waited for, and it fails when it must."""

import asyncio
import itertools

import pytest

from tests.support import eventually, eventually_async


def test_eventually_returns_the_first_truthy_value():
    counter = itertools.count()
    assert eventually(lambda: next(counter) >= 3 and "ready", timeout=5, interval=0) == "ready"


def test_eventually_fails_with_the_last_value_once_the_bound_passes():
    with pytest.raises(AssertionError, match=r"not within 0\.05s: the thing; last: 0"):
        eventually(lambda: 0, timeout=0.05, interval=0.01, what="the thing")


def test_eventually_async_fails_too():
    async def never():
        return None

    with pytest.raises(AssertionError, match="last: None"):
        asyncio.run(eventually_async(never, timeout=0.05, interval=0.01))
