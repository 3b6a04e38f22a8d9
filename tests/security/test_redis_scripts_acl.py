"""A Lua script runs with its caller's Redis rights: every command a service's scripts call must be
in that service's ACL (runtime/security/identities.py), or the script fails on the real,
authenticated Redis while every test on an unauthenticated one passes (issue 39: the upload cap's
ZCARD answered `internal` to every upload in the e2e stacks)."""

import importlib
import pathlib
import re

import pytest

from runtime.configuration.settings import load
from runtime.security.identities import redis_rules

CALL = re.compile(r"redis\.call\(\s*'([A-Za-z]+)'")
SCRIPTS = {  # identity -> the scripts it runs: (module, its *_LUA names)
    "scheduler": [
        (
            "services.scheduler.file_records",
            ["BEGIN_LUA", "RELEASE_LUA", "FINISH_LUA", "CLAIM_LUA", "DELETE_LUA"],
        ),
        ("services.scheduler.store", ["CAS_LUA", "LEASE_LUA"]),
        ("domain.quotas", ["BUCKET_LUA"]),
    ],
    "confirmation": [("domain.quotas", ["OUTSTANDING_LUA"])],
    "ledger": [("services.ledger.store", ["ACCEPT_LUA"])],
    "entitlement": [("services.entitlement.store", ["APPLY_LUA"])],
}


@pytest.mark.parametrize("identity", sorted(SCRIPTS))
def test_every_command_a_script_calls_is_in_its_callers_acl(identity, tmp_path):
    called: set[str] = set()
    for module, names in SCRIPTS[identity]:
        loaded = importlib.import_module(module)
        for name in names:
            found = CALL.findall(getattr(loaded, name))
            assert found, f"{module}.{name} calls nothing: the table is out of date"
            called |= {c.lower() for c in found}
    _, commands = redis_rules(identity, load({"ITO_DATA_DIR": str(tmp_path), "ITO_NAMESPACE": "tacl"}))
    allowed = {c[1:].lower() for c in commands.split() if c.startswith("+")}
    assert called - allowed == set(), f"{identity} may not call {sorted(called - allowed)}"


def test_every_script_in_the_services_is_in_the_table():
    repo = pathlib.Path(__file__).resolve().parents[2]
    found = {
        (".".join(path.relative_to(repo).with_suffix("").parts), name)
        for package in ("services", "domain", "runtime")  # where a script may live (issue 44's house)
        for path in (repo / package).rglob("*.py")
        for name in re.findall(r"^([A-Z_]+_LUA) = ", path.read_text(), re.M)
    }
    listed = {(module, name) for scripts in SCRIPTS.values() for module, names in scripts for name in names}
    assert found == listed
