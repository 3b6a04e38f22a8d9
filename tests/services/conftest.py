"""A Redis Cluster of our own (3 primaries, a replica each; ACLs, AOF always), started once for the
session by the first test that asks for it: the store contracts run on it as on a single server."""

import dataclasses

import pytest

from devstack import redis_cluster
from services.runtime.configuration import settings as settings_mod
from tests.conftest import new_namespace


class ClusterInfra:
    """The cluster and the settings that name it (`redis_cluster` on): connect as any identity.
    `cluster` is replaced when a test restarts a node, so that the teardown stops the new process."""

    def __init__(self, settings: settings_mod.Settings, cluster: redis_cluster.Cluster) -> None:
        self.settings = settings
        self.cluster = cluster

    def redis(self, identity: str = "admin"):
        from services.runtime.messaging import connections

        return connections.make_redis(self.settings, identity)


@pytest.fixture(scope="session")
def cluster_infra(tmp_path_factory):
    from devstack import authority

    root = tmp_path_factory.mktemp("redis-cluster")
    s = settings_mod.load(
        {"ITO_NAMESPACE": new_namespace(), "ITO_DATA_DIR": str(root), "ITO_REDIS_CLUSTER": "1"}
    )
    aclfile = authority.write_redis_acl(s)  # as `up` writes it: the credentials, then the users
    cluster = redis_cluster.start_cluster(root / "redis-cluster", aclfile, s.secrets_dir, root / "logs")
    infra = ClusterInfra(dataclasses.replace(s, redis_url=cluster.url), cluster)
    yield infra
    redis_cluster.stop_cluster(infra.cluster)
