"""Fixtures shared by the whole test tree, and how the suite is spread over pytest-xdist workers."""

from __future__ import annotations

import os

# One BLAS/OpenMP thread per process, set before numpy and torch are first imported (below) and
# inherited by every interpreter the tests start. The suite runs as many processes as there are
# cores (the xdist workers, verl's Ray workers, the runs' fresh interpreters); a second thread per
# process then only contends for a core, and OpenBLAS/OpenMP threads that wait for a busy core spin:
# on a busy 2-core machine a float64 np.convolve of 20k took 0.1 s with one thread and 0.6-35 s
# with two. The tests assert the same things at any thread count. Set a variable to override.
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

from verl_ext.cpu import CPU_PROCESS_ENV  # noqa: E402 (imports neither numpy nor torch)

# The CPU backend's Ray settings also for the clusters the tests start themselves (test_multinode),
# and its offline switches for every process: the suite never reaches for a hub, and every interpreter
# it starts imports the Hugging Face libraries in the same mode as the fork server (tests/support/forkserver.py).
os.environ.update({name: value for name, value in CPU_PROCESS_ENV.items() if name.startswith(("RAY_", "HF_", "TRANSFORMERS_"))})
# Ray's periodic reports, which no test reads: every 5 s each node's dashboard agent walks the node's processes
# and records metrics, and every process of a job reports its metrics. An idle two-node cluster took 7.3% of a
# core with them and 4.6% without (/proc/stat over 30 s, less this machine's 1.3% without a cluster).
os.environ.update({"REPORTER_UPDATE_INTERVAL_MS": "600000", "METRICS_RECORD_INTERVAL_S": "600", "RAY_metrics_report_interval_ms": "600000"})
# vLLM's log level, as verl's runtime environment sets it for every Ray worker of a run
# (verl/trainer/constants_ppo.py): the fork server preloads vLLM, which reads it when imported, and a
# child whose level differed from the server's would start as a fresh interpreter.
os.environ["VLLM_LOGGING_LEVEL"] = "WARN"

import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import pytest  # noqa: E402

from tests.support import config_cache, forkserver  # noqa: E402

# The interpreters the tests start are children of the suite's fork server (tests/support/forkserver.py,
# started by pytest_sessionstart below): on a pytest-xdist worker, the controller has started it.
if os.environ.get(forkserver.LAUNCHER_VARIABLE):
    sys.executable = os.environ[forkserver.LAUNCHER_VARIABLE]

from tests.cpu import helpers  # noqa: E402
from tests.cpu.helpers import BOTH_CORES_GROUP, RAY_GROUP  # noqa: E402
from verl_ext import cli  # noqa: E402


@pytest.fixture
def run_cli(capsys):
    """``verl-ext SUBCOMMAND ...`` through the real dispatcher (only that subcommand registered);
    returns (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        with mock.patch.dict(cli.COMMANDS, {argv[0]: cli.COMMANDS[argv[0]]}, clear=True):
            code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


# --------------------------------------------------------------------------- the CPU backend, its task and apps

#: Tests that run the CPU backend (directly or through the task and the apps).
CPU_TESTS = tuple(Path(__file__).parent / name for name in ("cpu", "tasks", "apps"))


def pytest_collection_modifyitems(config, items):
    """On a host with a CUDA GPU the CPU backend refuses to activate: skip its tests there."""
    import torch

    if torch.cuda.is_available():
        skip = pytest.mark.skip(reason="verl-ext's CPU backend refuses to run on a host with a CUDA GPU")
        for item in items:
            if any(directory in Path(item.fspath).parents for directory in CPU_TESTS):
                item.add_marker(skip)
    # The Ray group is the longest chain of the suite (see xdist_group): it starts first, and the
    # tests of two trainers at once run after it on its worker, while the other worker runs the rest.
    # Started beside the Ray group they made it take 308 s instead of 163 s; run last, once their
    # short trainer was done, their long one left a core idle for about half a minute.
    order = {RAY_GROUP: 0, BOTH_CORES_GROUP: 1}
    items.sort(key=lambda item: order.get(marked_group(item), 2))  # stable: the rest keep their order


# --------------------------------------------------------------------------- the xdist workers (setup.cfg: -n auto)


def marked_group(item: pytest.Item) -> str:
    """The ``xdist_group`` mark of ``item``, else its file."""
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return item.nodeid.split("::")[0]
    return str(mark.args[0] if mark.args else mark.kwargs["name"])


def xdist_group(item: pytest.Item) -> str:
    """The group of ``item``: a pytest-xdist worker runs each group whole, so that a module's
    fixtures (a verl run that all of the module's tests read) run once. A test's group is its
    marked group (:func:`marked_group`); the tests of two trainers at once join the Ray group, after
    its tests (why: ``pytest_collection_modifyitems``).

    The tests marked ``xdist_group(RAY_GROUP)`` start a Ray cluster; in one group they run one
    after the other: a second cluster beside one would share ``/tmp/ray``, and a plain
    ``ray.init()`` joins the cluster whose address ``ray.cluster_utils.Cluster`` wrote there
    (tests/e2e/test_multinode.py)."""
    group = marked_group(item)
    return RAY_GROUP if group == BOTH_CORES_GROUP else group


@pytest.hookimpl(tryfirst=True)  # before the worker sends its collection to the controller
def pytest_collection_finish(session):
    """``--dist loadgroup`` keeps the tests whose ids end in the same ``@group`` on one worker.
    pytest-xdist 3.8 appends that suffix to ``item._nodeid``, which pytest 9.2 no longer reads
    (it keeps the id in ``item._id``), so each test would be a group of its own: the suffix is
    written here, on each worker, for every test, the unmarked ones with their file's group."""
    if not getattr(session.config.option, "loadgroup", False):  # not a worker of --dist loadgroup
        return
    for item in session.items:
        suffix = f"@{xdist_group(item)}"
        if item.nodeid.endswith(suffix):
            continue
        if hasattr(item, "_id"):  # pytest >= 9.2
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(item.nodeid + suffix)
        else:
            item._nodeid = item.nodeid + suffix
        if not item.nodeid.endswith(suffix):
            raise pytest.UsageError(f"cannot group {item.nodeid} for pytest-xdist; run with -n 0")


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """In a pytest-xdist worker, once its tests are collected: what collecting made (the test modules, the
    items, about 140,000 objects) is frozen out of the garbage collector's full passes, as the fork server
    does with what it preloaded; it lives to the worker's end anyway. The workers' full passes took 16 s
    of CPU in a suite, 7 s with this (a ``gc.callbacks`` timer in each worker). Objects die by their
    references as before; only a cycle among the frozen ones would no longer be collected."""
    if hasattr(session.config, "workerinput"):
        import gc

        gc.collect()
        gc.freeze()


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core this process may use, at most 4 (the suite has a few long
    groups; more workers would each import verl for little gain). $PYTEST_XDIST_AUTO_NUM_WORKERS
    still decides when set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return max(1, min(4, len(os.sched_getaffinity(0))))


@pytest.fixture(scope="session")
def assets_dir() -> Path:
    """The asset cache every test and ``make demo`` share (``$VERL_EXT_CPU_ASSETS``, else
    ``~/.cache/verl_ext/cpu_assets``): building the assets takes about a minute, so the suite
    builds them at most once (the cache is keyed by everything that determines them)."""
    from verl_ext.tasks.common import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="session")
def assets(assets_dir):
    """The built assets (when the cache is empty, one xdist worker builds while the other waits)."""
    from verl_ext.tasks import get_task

    return get_task("arith").build_assets(assets_dir)


@pytest.fixture(scope="session")
def tool_assets(assets_dir):
    """The tool task's built assets, likewise."""
    from verl_ext.tasks import get_task

    return get_task("tool").build_assets(assets_dir)


def pytest_sessionstart(session):
    """Every run of the suite starts its fork server (tests/support/forkserver.py; the pytest-xdist workers,
    started next, are its first children), unless ``VERL_EXT_TEST_FORKSERVER=0``; in a run of the
    whole suite, with it the servers its trainer runs ask for (forkserver.SUITE_SERVERS).

    A run of the whole suite also starts building every task's assets at once, one process per task,
    before the workers start: on an empty cache (a fresh machine) they are built side by side (about a
    minute each) rather than one after the other inside the tests that first need them, one of which
    is the Ray group, the suite's longest chain. The tests' fixtures read them as usual: a fixture
    that asks while a build is in progress waits for it (the cache's lock). On a full cache this is a
    check of the cache that takes a few seconds."""
    config = session.config
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        config_cache.install()  # where tests run: Hydra's YAML files parsed once (tests/support/config_cache.py)
    if hasattr(config, "workerinput") or config.option.collectonly:
        return  # a worker: the controller started the server and the builds
    whole = config.args == list(config.getini("testpaths"))
    if os.environ.get(forkserver.SWITCH_VARIABLE, "1") != "0":
        config._forkserver = forkserver.start(prestart=forkserver.SUITE_SERVERS if whole else ())
        sys.executable = os.environ[forkserver.LAUNCHER_VARIABLE] = str(config._forkserver.launcher)
    if not whole:
        return  # only some of the tests
    import subprocess

    build = "import sys; from verl_ext.tasks import get_task; get_task(sys.argv[1]).build_assets()"
    config._asset_builds = [
        # quiet: a build that fails here fails again, with its output, in the first test that needs it
        subprocess.Popen([sys.executable, "-c", build, name], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name in ("arith", "tool")
    ]


def pytest_sessionfinish(session):
    for process in getattr(session.config, "_asset_builds", ()):
        process.wait()
    if hasattr(session.config, "_forkserver"):
        session.config._forkserver_stats = session.config._forkserver.stop()


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "_forkserver_stats"):
        terminalreporter.write_line(f"fork server (tests/support/forkserver.py): {config._forkserver_stats}")


@pytest.fixture(scope="session")
def cpu_env(assets_dir):
    """The environment of a CPU run writing into ``output_dir``."""

    def make(output_dir: Path) -> dict[str, str]:
        from verl_ext.cpu.overrides import cpu_environment

        return {**os.environ, **cpu_environment(output_dir), "VERL_EXT_CPU_ASSETS": str(assets_dir)}

    return make


@pytest.fixture(scope="session")
def scenario(cpu_env, assets):
    """Run ``scenarios.py <name> <output_dir> [args]`` in a fresh interpreter; return the output dir."""

    def run_scenario(name: str, output_dir: Path, *args: str, timeout: int = 240) -> Path:
        output_dir.mkdir(parents=True, exist_ok=True)
        helpers.run([sys.executable, str(helpers.SCENARIOS), name, str(output_dir), *args], cpu_env(output_dir), output_dir, timeout)
        return output_dir

    return run_scenario

