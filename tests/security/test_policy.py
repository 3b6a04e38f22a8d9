"""The authorization policy as tables (pure): who may publish, subscribe and touch which keys.

These pin the allow-lists that runtime/security/identities.py writes into the nats-server config
and the Redis ACL file; the attacks in test_attacks.py check the servers enforce them."""

import json

import pytest

from runtime.configuration import settings as settings_mod
from runtime.security import identities as ids
from runtime.security.order_signatures import Signer, Verifier

S = settings_mod.load({"ITO_NAMESPACE": "ito", "ITO_DATA_DIR": "/tmp/x"})


def allows(patterns, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` the rest."""
    for pattern in patterns:
        p, s = pattern.split("."), subject.split(".")
        for i, token in enumerate(p):
            if token == ">":
                if len(s) > i:
                    return True
                break
            if i >= len(s) or (token != "*" and token != s[i]):
                break
        else:
            if len(p) == len(s):
                return True
    return False


def pub(identity: str, subject: str) -> bool:
    return allows(ids.nats_permissions(identity, S).publish, subject)


def sub(identity: str, subject: str) -> bool:
    return allows(ids.nats_permissions(identity, S).subscribe, subject)


SERVICES_AND_UPSTREAM = [i for i in ids.NATS_IDENTITIES if i != ids.OPERATOR]


@pytest.mark.parametrize(
    "subject, only",
    [
        ("ito.v1.ledger.accept", {"scheduler"}),
        ("ito.v1.confirmation.create", {"scheduler"}),
        ("ito.v1.entitlement.eligibility", {"scheduler"}),
        ("ito.v1.trainer.cleanup", {"scheduler"}),
        ("ito.v1.trainer.export", {"scheduler"}),
        ("ito.v1.trainer.download", {"scheduler"}),
        ("ito.v1.trainer.sample", {"scheduler"}),
        ("ito.v1.control.cancel.run_1", {"scheduler"}),
        ("ito.v1.work.train.run_1", {"scheduler"}),
        ("ito.v1.audit.run_1", {"scheduler"}),
        ("ito.compute.v1.requests.release", {"scheduler"}),
        ("ito.v1.run.run_1.created", {"scheduler"}),
        ("ito.v1.run.run_1.state", {"trainer"}),
        ("ito.v1.run.run_1.log", {"trainer"}),
        ("ito.v1.scheduler.lease", {"trainer"}),
        ("ito.compute.v1.booking.completed", {"compute"}),
        ("desk.telemetry.rollup.region.x", {"telemetry"}),
        ("desk.live.run_1", {"telemetry"}),
        ("ito.v1.desk.runs", {"desk"}),  # the desk's reads of the scheduler: the desk (and operator) only
        ("ito.v1.desk.run", {"desk"}),
        ("$JS.API.STREAM.PURGE.ITO_AUDIT", set()),
        ("$JS.API.STREAM.DELETE.ITO_AUDIT", set()),
        ("$JS.API.STREAM.CREATE.ITO_EVIL", set()),
        ("$JS.API.STREAM.UPDATE.ITO_AUDIT", set()),
        ("$JS.API.STREAM.MSG.DELETE.ITO_AUDIT", set()),
        ("$JS.API.CONSUMER.CREATE.ITO_WORK.ito-trainer", {"trainer"}),
        ("$JS.API.CONSUMER.MSG.NEXT.ITO_WORK.ito-trainer", {"trainer"}),
        ("_INBOX_t_acme.abc", set()),
    ],
)
def test_only_the_owner_may_publish(subject, only):
    assert {i for i in SERVICES_AND_UPSTREAM if pub(i, subject)} == only


@pytest.mark.parametrize(
    "subject, only",
    [
        ("ito.v1.api.train.acme", {"scheduler"}),
        ("ito.v1.api.export.acme", {"scheduler"}),
        ("ito.v1.api.download.acme", {"scheduler"}),
        ("ito.v1.api.sample.acme", {"scheduler"}),
        ("ito.v1.trainer.export", {"trainer"}),
        ("ito.v1.trainer.download", {"trainer"}),
        ("ito.v1.trainer.sample", {"trainer"}),
        ("ito.v1.api.models.acme", {"scheduler"}),  # the model store's list: the scheduler answers it
        ("ito.v1.api.runs.acme", {"scheduler"}),  # an account's own runs: the scheduler answers it
        ("ito.v1.ledger.accept", {"ledger"}),
        (
            "ito.v1.work.train.run_1",
            set(),
        ),  # delivered through the trainer's own consumer, not a raw subscription
        ("ito.v1.control.cancel.run_1", {"trainer"}),
        ("ito.compute.v1.requests.release", {"compute"}),
        ("desk.telemetry.run.x", {"desk"}),
        ("desk.live.run_1", {"desk"}),
        ("ito.v1.desk.runs", {"scheduler"}),
        ("ito.v1.desk.run", {"scheduler"}),
        ("_INBOX_t_acme.abc", set()),
        ("ito.v1.run.run_1.state", set()),
    ],
)
def test_only_the_owner_may_subscribe(subject, only):
    assert {i for i in SERVICES_AND_UPSTREAM if sub(i, subject)} == only


def test_a_tenant_publishes_its_own_requests_and_reads_its_own_inbox_only():
    p = ids.tenant_permissions("acme", S)
    assert allows(p.publish, "ito.v1.api.train.acme") and allows(p.publish, "ito.v1.api.status.acme")
    for verb in ("export", "download", "sample"):  # its own account's only
        assert allows(p.publish, f"ito.v1.api.{verb}.acme") and not allows(
            p.publish, f"ito.v1.api.{verb}.victim"
        )
    assert allows(p.publish, "ito.v1.api.models.acme")
    assert allows(p.publish, "ito.v1.api.runs.acme")
    for subject in (
        "ito.v1.api.train.victim",
        "ito.v1.api.models.victim",  # another account's model list
        "ito.v1.api.runs.victim",  # another account's runs
        "ito.v1.ledger.accept",
        "ito.v1.confirmation.create",
        "ito.compute.v1.booking.completed",
        "ito.v1.run.r.state",
        "ito.v1.control.cancel.r",
        "ito.v1.trainer.cleanup",
        "ito.v1.trainer.export",
        "ito.v1.trainer.download",
        "ito.v1.trainer.sample",
        "ito.v1.audit.r",
        "ito.v1.desk.runs",
        "ito.v1.desk.run",
        "$JS.API.STREAM.PURGE.ITO_AUDIT",
        "ito.v1.api.train.acme.x",
    ):
        assert not allows(p.publish, subject), subject
    assert allows(p.subscribe, "_INBOX_t_acme.x")
    for subject in ("ito.>", ">", "_INBOX_t_victim.x", "_INBOX_svc_scheduler.x", "ito.v1.api.train.victim"):
        assert not allows(p.subscribe, subject), subject
    assert p.responses is False


def test_the_config_has_no_anonymous_user_and_every_user_a_permission_set():
    services = {i: f"U{i.upper():A<55}"[:56] for i in ids.NATS_IDENTITIES}
    config = json.loads(
        ids.nats_config(S, port=4222, store_dir="/x", services=services, tenants=[("acme", "UACME")])
    )
    users = config["authorization"]["users"]
    assert "no_auth_user" not in config and "users" not in {k for k in config if k != "authorization"}
    assert len(users) == len(ids.NATS_IDENTITIES) + 1
    assert all("permissions" in u and set(u) == {"nkey", "permissions"} for u in users)
    ledger = next(u for u in users if u["nkey"] == services["ledger"])["permissions"]
    assert ledger["publish"] == {"deny": [">"]}  # nothing to publish: an explicit deny, not an empty allow


def test_redis_acl_default_off_and_each_user_confined():
    acl = ids.redis_acl(S, {i: "pw-" + i for i in ids.REDIS_IDENTITIES}).splitlines()
    assert acl[0].startswith("user default off")
    assert not any("pw-" in line for line in acl)  # only SHA-256 digests
    by_user = {line.split()[1]: line for line in acl}
    assert "trainer" not in by_user  # the trainer holds no Redis credential
    assert "~ito:{*}:idem:*" in by_user["ledger"] and "~ito:apikeys:*" not in by_user["ledger"]
    assert "~*" not in by_user["scheduler"] and "+@all" not in by_user["scheduler"]
    for user, line in by_user.items():
        if user not in ("admin", "default"):
            assert (
                "-@all" in line and "+flushall" not in line and "+acl" not in line and "+config" not in line
            )


def test_redis_cluster_adds_only_what_its_client_and_replicas_need():
    """A replica logs in to its primary with PSYNC/REPLCONF and no key; a service's cluster client
    may read the slot map and the command table, not change the cluster."""
    by_user = {
        line.split()[1]: line.split()
        for line in ids.redis_acl(S, {i: "pw" for i in ids.REDIS_IDENTITIES}).splitlines()
    }
    replication = by_user[ids.REPLICATION]
    assert "+psync" in replication and "+replconf" in replication
    assert not [t for t in replication if t.startswith("~") or t in ("+get", "+@all", "+cluster|slots")]
    for user in (*ids.REDIS_SERVICES, ids.ACCOUNTS):
        rights = by_user[user]
        assert "+cluster|slots" in rights and "+command" in rights
        assert not [t for t in rights if t.startswith("+cluster") and t != "+cluster|slots"]
        assert "+readonly" not in rights and "+asking" not in rights
    keys = {user: [t for t in line if t.startswith("~")] for user, line in by_user.items()}
    # the indexes and counters every account writes are sharded (the single keys of before stay
    # listed where data written then is still read); the scheduler no longer reads the accounts
    assert "~ito:leased:*" in keys["scheduler"] and "~ito:accounts" not in keys["scheduler"]
    assert "~ito:booking-stats:*" in keys["entitlement"] and "~ito:accounts:*" in keys["ledger"]


def test_signatures_bind_subject_body_and_time():
    from nacl.signing import SigningKey

    key = SigningKey.generate()
    signer, verifier = Signer(bytes(key)), Verifier(bytes(key.verify_key))
    headers = signer.headers("ito.v1.ledger.accept", b"{}", now=1000.0)
    assert verifier.valid("ito.v1.ledger.accept", b"{}", headers, now=1001.0)
    assert not verifier.valid("ito.v1.ledger.lookup", b"{}", headers, now=1001.0)  # another subject
    assert not verifier.valid("ito.v1.ledger.accept", b'{"a":1}', headers, now=1001.0)  # another body
    assert not verifier.valid("ito.v1.ledger.accept", b"{}", headers, now=1100.0)  # replayed later
    assert verifier.valid("ito.v1.ledger.accept", b"{}", headers, now=1100.0, max_age_s=None)  # work items
    assert not verifier.valid("ito.v1.ledger.accept", b"{}", {}, now=1000.0)
    other = Signer(bytes(SigningKey.generate())).headers("ito.v1.ledger.accept", b"{}", now=1000.0)
    assert not verifier.valid("ito.v1.ledger.accept", b"{}", other, now=1000.0)  # another key
