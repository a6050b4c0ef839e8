"""The Ray cluster of the suite: every test that runs verl on Ray (the ``RAY_GROUP`` tests, one
after the other on one pytest-xdist worker) joins this one cluster, started once, instead of starting
its own (about 15-20 s each on a 2-core machine).

Covers no module of verl-ext itself: what the Ray tests check is in their own files."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import marked_group
from tests.cpu.helpers import RAY_GROUP

ROOT = Path(__file__).resolve().parents[2]


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
    the CPUs and the logical GPUs the CPU backend's runs reserve (verl_ext/cpu/overrides.py)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "num_gpus": 0, "include_dashboard": False})
    # two logical GPUs: the selftest's runs train on two data-parallel ranks, the other runs on one
    worker = cluster.add_node(num_cpus=8, num_gpus=2, resources={WORKER_RESOURCE: 1})
    cluster.wait_for_nodes()
    _running.append(cluster)
    yield RayCluster(cluster.address, cluster.head_node.node_id, worker.node_id)
    while _running:
        _running.pop().shutdown()


#: The suite's cluster while it runs.
_running: list = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The cluster ends with the Ray group's last test rather than with the session: idle, its processes
    took about 7% of a core, for the minutes its worker then spends on other tests (the Ray group runs first:
    tests/conftest.py)."""
    yield
    if _running and marked_group(item) == RAY_GROUP and (nextitem is None or marked_group(nextitem) != RAY_GROUP):
        _running.pop().shutdown()


@pytest.fixture(scope="session")
def v1_run(tmp_path_factory, assets_dir, tool_assets, ray_cluster):
    """The suite's one run of verl's V1 trainer (tests/e2e/v1_run.py: the tool task through verl's vLLM server in
    verl's GPU settings, with the README's user estimator, per-turn rewards, the rollout correction and cut
    responses), made once for tests/e2e/test_v1_trace.py and test_tool_on_ray.py. Returns its output directory."""
    from tests.e2e.v1_run import make_v1_run

    return make_v1_run(tmp_path_factory.mktemp("v1"), assets_dir, ray_cluster)


def wandb_offline(out: Path) -> dict[str, str]:
    """The environment of a W&B run that stays on this machine: offline (no network), every file of W&B's
    under ``out`` (its runs in ``out/wandb/wandb/offline-run-*``), none in the user's home."""
    (out / "wandb").mkdir(exist_ok=True)
    return {
        "WANDB_MODE": "offline", "WANDB_DIR": str(out / "wandb"), "WANDB_CONFIG_DIR": str(out / "wandb" / "config"),
        "WANDB_CACHE_DIR": str(out / "wandb" / "cache"), "WANDB_DATA_DIR": str(out / "wandb" / "data"),
    }  # fmt: skip


@pytest.fixture(scope="session")
def selftest_run(tmp_path_factory, assets_dir, assets, ray_cluster):
    """``verl-ext selftest --precision bf16 -- <overrides>`` as a user types it, on this cluster
    (``RAY_ADDRESS``): its two runs of verl's legacy trainer (mc with its critic, grpo with groups) in
    verl's GPU settings (tests/e2e/gpu_world.py: bf16, packed sequences, entropy in the loss, dynamic
    batch size) on two data-parallel ranks, with a probe of the plugin's activation in every process (tests/e2e/activation_probe.py),
    and verl's W&B logger beside its file logger, offline, its files in the output directory (:func:`wandb_offline`).
    Read by tests/e2e/test_selftest.py and test_multinode.py.
    Returns (output directory, probe directory, the completed selftest)."""
    # its own runs: one selftest serves the three files (the suite's only legacy runs on Ray)
    from tests.e2e.gpu_world import GPU_WORLD_OVERRIDES

    out = tmp_path_factory.mktemp("selftest")
    probes = out / "probes"
    probes.mkdir()
    probe = {"VERL_USE_EXTERNAL_MODULES": "tests.e2e.activation_probe", "VERL_EXT_TEST_PROBE_DIR": str(probes)}
    overrides = [
        *GPU_WORLD_OVERRIDES,
        "trainer.n_gpus_per_node=2",  # two data-parallel ranks (gloo): the update rows cross from both
        # a rank's share of an mc mini-batch is 2 sequences of 15-20 tokens: a budget that still splits it,
        # above the longest possible sequence (prompts up to 11 tokens, responses up to 16)
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=28",
        "critic.ppo_max_token_len_per_gpu=28",
        *(f"+ray_kwargs.ray_init.runtime_env.env_vars.{name}='{value}'" for name, value in probe.items()),
        f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH='{ROOT}'",
        "trainer.logger=[console,file,wandb]",  # the task runner's environment says where W&B writes
        *(f"+ray_kwargs.ray_init.runtime_env.env_vars.{name}='{value}'" for name, value in wandb_offline(out).items()),
    ]
    env = {
        **os.environ, **probe, "PYTHONPATH": str(ROOT), "VERL_EXT_CPU_ASSETS": str(assets_dir), "RAY_ADDRESS": ray_cluster.address,
    }  # fmt: skip
    script = Path(sysconfig.get_path("scripts"), "verl-ext")  # run as its #! line runs it, by the suite's interpreter
    # verl-ext's HF-generate rollout: with vLLM's CPU build installed the selftest would take vLLM, two servers
    # (one per data-parallel rank) for each of the two runs; vLLM's own runs are tests/e2e/test_vllm_rollout.py's
    command = [
        sys.executable, str(script), "selftest", "--output-dir", str(out), "--precision", "bf16", "--rollout", "hf_generate", "--", *overrides,
    ]  # fmt: skip
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    (out / "selftest.log").write_text(completed.stdout + completed.stderr)
    return out, probes, completed
