"""The suite's fork server (tests/support/forkserver.py) against the real interpreter: a command run through
the launcher sees what it sees when the real interpreter runs it (arguments, ``__main__``, working
directory, environment, ``sys.path``, standard streams, inherited file descriptors, umask, signal
handlers, hash seed, warnings options), ends the same way (exit codes, tracebacks, signals), and dies
with its launcher. The expected values are the real interpreter's own, run beside it.

Covers: tests/support/forkserver.py (the launcher, the server, the servers per hash seed, the refusals)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support import forkserver
from tests.support.forkserver import real_python

LAUNCHER = os.environ.get(forkserver.LAUNCHER_VARIABLE)
pytestmark = pytest.mark.skipif(not LAUNCHER, reason=f"the suite runs without its fork server ({forkserver.SWITCH_VARIABLE}=0)")

PROBE = r'''
import json, os, signal, sys, warnings
report = {
    "argv": sys.argv, "name": __name__, "file": globals().get("__file__"), "cwd": os.getcwd(),
    "path": [p for p in sys.path[:3]], "variable": os.environ.get("PROBE_VARIABLE"),
    "stdin": sys.stdin.read(), "inherited": os.read(int(os.environ["PROBE_FD"]), 100).decode() if "PROBE_FD" in os.environ else None,
    "umask": os.umask(0o22), "signals": [str(signal.getsignal(n)) for n in (signal.SIGINT, signal.SIGPIPE, signal.SIGTERM, signal.SIGCHLD)],
    "warnings": [f[0] for f in warnings.filters[:1]] if sys.warnoptions else [], "tests_preloaded": "tests" in sys.modules,
    "buffering": [(s.line_buffering, s.write_through, type(s.buffer).__name__) for s in (sys.stdout, sys.stderr)],
}
print(json.dumps(report))
'''


def both(argv: list[str], tmp_path: Path, **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    return tuple(
        subprocess.run([python, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60, **kwargs)
        for python in (real_python(), LAUNCHER)
    )


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "probe_module.py").write_text(PROBE)
    return tmp_path


@pytest.mark.parametrize("form", ["script", "-c", "-m", "-u -W error script"])
def test_a_command_sees_what_it_sees_in_the_real_interpreter(form, probe):
    options = form.split()[:-1]
    command = {"script": ["probe.py"], "-c": ["-c", PROBE], "-m": ["-m", "probe_module"]}[form.split()[-1]]
    extra = probe / "extra"
    results = []
    for python in (real_python(), LAUNCHER):
        read, write = os.pipe()
        os.write(write, b"through a pipe")
        os.close(write)
        env = {**os.environ, "PROBE_VARIABLE": "mine", "PYTHONPATH": str(extra), "PROBE_FD": str(read)}
        try:
            completed = subprocess.run(
                [python, *options, *command, "an argument"], cwd=probe, env=env, input="on stdin", pass_fds=(read,),
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
        finally:
            os.close(read)
        assert completed.returncode == 0, completed.stderr
        results.append(json.loads(completed.stdout))
    real, forked = results
    assert forked == real
    assert real["path"][1] == str(extra) and real["inherited"] == "through a pipe" and real["stdin"] == "on stdin"


def test_a_command_runs_in_a_forked_child_with_the_libraries_loaded(tmp_path):
    code = "import sys; print(sys.executable, 'torch' in sys.modules, 'verl' in sys.modules)"
    real, forked = both(["-c", code], tmp_path)
    assert real.stdout.split()[1:] == ["False", "False"]
    assert forked.stdout.split() == [LAUNCHER, "True", "False"]  # verl itself: imported by each child


def test_each_command_draws_its_own_random_numbers_as_in_the_real_interpreter(tmp_path):
    """A real interpreter seeds numpy's and torch's default generators from the OS, so two commands draw
    different numbers (a CPU run's fresh value head, unseeded, was another one in each run); two children
    of one server would otherwise both draw from the state the server had when it forked them."""
    code = "import numpy, torch; print(numpy.random.random(), torch.rand(1).item(), torch.initial_seed())"
    (real, first), (again, second) = both(["-c", code], tmp_path), both(["-c", code], tmp_path)
    assert real.stdout.split() != again.stdout.split()  # the real interpreter, twice: the reference
    assert all(a != b for a, b in zip(first.stdout.split(), second.stdout.split())), (first.stdout, second.stdout)


@pytest.mark.parametrize(
    "code",
    [
        "import sys; sys.exit(3)",
        "import sys; sys.exit('a message')",
        "def f():\n    raise ValueError('boom')\nf()",
        "import os, signal; os.kill(os.getpid(), signal.SIGTERM)",
        "raise KeyboardInterrupt",
    ],
)
def test_it_ends_as_in_the_real_interpreter(code, tmp_path):
    real, forked = both(["-c", code], tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)


#: What a command leaves to the interpreter's shutdown: a thread still running, an atexit function,
#: a finalizer, objects whose __del__ prints (in __main__ and in a module it imported, one in a
#: reference cycle), and files written but never closed (in __main__ and held by a preloaded library).
LEAVES = r'''
import atexit, threading, time, weakref, sys, logging
class Noisy:
    def __init__(self, name): self.name = name
    def __del__(self): print("del", self.name, flush=True)
def late():
    time.sleep(0.2)
    print("thread done")
threading.Thread(target=late).start()
atexit.register(print, "atexit")
import leaver
main_object, cycle = Noisy("main"), Noisy("cycle")
cycle.itself = cycle
weakref.finalize(Noisy, print, "finalized")
unclosed = open("main.txt", "w")
unclosed.write("kept")
logging.getLogger("verl-ext-test").addHandler(logging.StreamHandler(open("held.txt", "w")))
logging.getLogger("verl-ext-test").error("logged")
print("end of script")
'''
LEAVER = "from __main__ import Noisy\nmodule_object = Noisy('module')\n"
FORKED_ENDINGS = 6


def test_what_a_command_leaves_at_exit_ends_as_in_the_real_interpreter(tmp_path):
    def ending(python: str, directory: Path) -> tuple:
        directory.mkdir()
        (directory / "leaves.py").write_text(LEAVES)
        (directory / "leaver.py").write_text(LEAVER)
        completed = subprocess.run([python, "leaves.py"], cwd=directory, capture_output=True, text=True, timeout=60)
        # the order of what runs at exit is not Python's to promise (finalizers of one garbage cycle, atexit
        # functions registered by the preloaded libraries): after the script and its thread, the same lines
        lines = completed.stdout.splitlines()
        files = (directory / "main.txt").read_text(), (directory / "held.txt").read_text()
        return completed.returncode, lines[:2], sorted(lines[2:]), completed.stderr, files

    real = ending(real_python(), tmp_path / "real")
    assert real[1:3] == (["end of script", "thread done"], ["atexit", "del cycle", "del main", "del module", "finalized"])
    assert real[4] == ("kept", "logged\n")
    # several children: the garbage collector's order varies from run to run, and with it what a wrong
    # teardown loses (a file's buffered data was lost in about half the runs before the fix)
    for run in range(FORKED_ENDINGS):
        assert ending(LAUNCHER, tmp_path / f"forked{run}") == real


def test_the_hash_seed_a_command_asks_for_is_the_one_it_gets(tmp_path):
    code = "import sys; print(hash('verl-ext'), 'torch' in sys.modules)"
    seed = "0"  # the seed of the suite's trainer runs (their Ray workers): this test shares their server
    real, forked = both(["-c", code], tmp_path, env={**os.environ, "PYTHONHASHSEED": seed})
    assert forked.stdout.split()[0] == real.stdout.split()[0]
    assert forked.stdout.split()[1] == "True"  # from the server with that seed


def test_a_breakpoint_hook_set_by_rays_driver_is_a_childs_own(tmp_path):
    """ray.init sets PYTHONBREAKPOINT in its process (a test's, through verl-ext's parallel check): the commands
    that test starts afterwards still run forked, and breakpoint() calls the hook their environment names."""
    code = "import sys; breakpoint('the hook'); print('torch' in sys.modules)"
    real, forked = both(["-c", code], tmp_path, env={**os.environ, "PYTHONBREAKPOINT": "builtins.print"})
    assert real.stdout.split("\n")[0] == forked.stdout.split("\n")[0] == "the hook"
    assert forked.stdout.split("\n")[1] == "True", forked.stdout


def test_what_a_child_cannot_reproduce_runs_in_the_real_interpreter(tmp_path):
    code = "import sys; print('torch' in sys.modules, sys.flags.optimize)"
    for argv, env in ((["-O", "-c", code], {}), (["-c", code], {"OMP_NUM_THREADS": "2"})):
        real, forked = both(argv, tmp_path, env={**os.environ, **env})
        assert forked.stdout == real.stdout and forked.stdout.split()[0] == "False"


SPAWNING = """
import multiprocessing, sys
def work(queue):
    queue.put((sum(range(10)), "torch" in sys.modules, multiprocessing.parent_process() is not None))
if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=work, args=(queue,))
    process.start()
    print(*queue.get(timeout=60))
    process.join()
    print(process.exitcode)
"""


def test_a_multiprocessing_child_is_forked_only_where_its_parent_allows_it(tmp_path):
    """A spawned ``multiprocessing`` child runs in the real interpreter, unless the spawning process's
    environment says its children never ask for their parent (forkserver.SPAWNED_VARIABLE); either way it
    does and prints what the real interpreter's child does."""
    (tmp_path / "spawning.py").write_text(SPAWNING)
    for allowed in ("", "1"):
        real, forked = both(["spawning.py"], tmp_path, env={**os.environ, forkserver.SPAWNED_VARIABLE: allowed})
        assert real.stdout == "45 False True\n0\n", real.stdout + real.stderr
        assert forked.stdout == f"45 {bool(allowed)} True\n0\n", forked.stdout + forked.stderr


def test_rays_worker_shim_runs_in_a_server_of_its_own_and_execs_the_worker(tmp_path):
    """Ray's setup_worker.py (forkserver.RAY_SHIM) gives the command it execs its runtime environment's variables, as
    in the real interpreter, from a child of the shim's server (its socket beside the launcher)."""
    import ray

    shim = str(Path(ray.__file__).parent / "_private" / "workers" / "setup_worker.py")
    context = json.dumps({"env_vars": {"PROBE_VARIABLE": "from the runtime env"}})
    code = "import os, sys; print(os.environ['PROBE_VARIABLE'], 'ray' in sys.modules)"
    real, forked = both([shim, f"--serialized-runtime-env-context={context}", "--language=PYTHON", "-c", code], tmp_path)
    assert real.stdout == forked.stdout == "from the runtime env False\n", (real.stderr, forked.stderr)
    assert (Path(LAUNCHER).parent / forkserver.server_name("random", shim=True)).exists()


def test_a_signal_to_the_launcher_reaches_the_command(tmp_path):
    code = "import sys, time; print('ready', flush=True); time.sleep(60)"
    for python in (real_python(), LAUNCHER):
        process = subprocess.Popen([python, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == -signal.SIGINT and stderr.rstrip().endswith("KeyboardInterrupt")


def test_killing_the_launcher_kills_the_command(tmp_path):
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    process = subprocess.Popen([LAUNCHER, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(process.stdout.readline())
    assert child != process.pid
    process.kill()
    process.wait(timeout=10)
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"the command {child} outlived its launcher")
