"""The Ray cluster of the suite: every test that runs verl on Ray (the ``RAY_GROUP`` tests, one
after the other on one pytest-xdist worker) joins this one cluster, started once, instead of starting
its own (about 15-20 s each on a 2-core machine).

Covers no module of verl-ext itself: what the Ray tests check is in their own files."""

from __future__ import annotations

from dataclasses import dataclass

import pytest


#: A custom resource only the worker node has.
WORKER_RESOURCE = "verl_ext_worker"


@dataclass(frozen=True)
class RayCluster:
    address: str
    head_node: str
    worker_node: str
    #: What a V1 run on this cluster adds to its overrides: TransferQueue puts its storage actors on the
    #: alive nodes in the order of their (random) ids, one on the first with our single storage unit; on
    #: the head, which has no CPU, it could never start. It goes where the worker resource is.
    v1_overrides: tuple[str, ...] = (f"+transfer_queue.backend.SimpleStorage.required_node_resource={WORKER_RESOURCE}",)


@pytest.fixture(scope="session")
def ray_cluster(assets):
    """Two nodes on this machine: a head without CPUs, so that verl's TaskRunner and its workers run on
    the other node (tests/e2e/test_multinode.py asserts what that means for the trace), which declares
    the CPUs and the logical GPU the CPU backend's runs reserve (verl_ext/cpu/overrides.py)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 0, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=8, num_gpus=1, resources={WORKER_RESOURCE: 1})
    cluster.wait_for_nodes()
    yield RayCluster(cluster.address, cluster.head_node.node_id, worker.node_id)
    cluster.shutdown()
