"""A Python interpreter that starts in milliseconds, for the interpreters the suite starts.

Much of the suite's time was interpreters importing the same libraries: every trainer run, each of
the six or seven Ray workers of a run, every fresh ``python -c "import verl"`` spent about 6 s of
CPU importing torch, torch._dynamo (through tensordict), transformers and datasets before the first
line of the code under test ran (about 200 interpreters per suite). Here one server process imports
them once (``PRELOADED``) and forks a child for each interpreter the suite starts; the child runs
its command as a fresh interpreter would: its own arguments, environment, working directory, umask,
open file descriptors, ``sys.path``, standard streams, signal handlers, exit status and hash seed
(a server per ``PYTHONHASHSEED`` asked for: verl's runs set it for their Ray workers), and ends as
an interpreter's shutdown ends it, except that it leaves the preloaded libraries as they are
(:func:`finish`). Ray's worker shim, which only sets a worker's environment and execs it, runs in a
server of its own that loads just what it imports (:data:`RAY_SHIM`).

verl and verl-ext are never preloaded: what they do when imported (the plugin's activation from its
entry point, the CPU backend's switch) happens in each child, from its own environment, as in a
fresh interpreter; so are tensordict and Ray, which read what verl sets when imported. A command a
child cannot reproduce exactly runs in a real interpreter instead
(:func:`refusal`): an interpreter option other than ``-u``, ``-B`` and ``-W``, a ``multiprocessing``
child (unless its parent allows it: :data:`SPAWNED_VARIABLE`), or an environment that differs from the
server's in a variable that the preloaded libraries read while they were imported (recorded then), or
that native code may read then (``OMP_*``, ...).

How a command gets here: tests/conftest.py starts the server once per test session and sets
``sys.executable`` to the *launcher*, a script written beside the server's socket that has the real
interpreter on its ``#!`` line. Whatever the suite starts through ``sys.executable`` (the tests'
subprocesses, the apps' runs, the workers of the Ray cluster the suite starts) runs the launcher,
which sends its command, environment and file descriptors to the server, forwards the signals it
receives to the child, and exits as the child did; a child killed with its launcher is killed with
its process group. ``VERL_EXT_TEST_FORKSERVER=0`` runs the suite without it.

Why not a standard mechanism: ``multiprocessing``'s forkserver forks a preloaded server too, but only
runs a Python function for a process that calls ``multiprocessing``; what the suite starts is
``sys.executable`` with arguments, from subprocess, from the apps and from Ray's own C++ processes,
and only an executable (the launcher) stands in for that. A child can neither simply return (its
shutdown, ``Py_FinalizeEx``, would free the preloaded libraries: about 0.45 s of CPU each) nor end
with ``os._exit`` alone (it would skip what a command's end must do: ``atexit``, joining its threads,
flushing its files); hence :func:`finish`, the part of the shutdown that touches only the child's own.

``python -m tests.support.forkserver DIRECTORY [NAME [PRESTART ...]]`` serves until its standard input closes."""

from __future__ import annotations

import builtins
import collections
import gc
import importlib
import io
import json
import os
import pickle
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import types
import weakref
from pathlib import Path

#: Imported once by the server: what verl's processes import besides verl, tensordict and ray (which
#: then take about 0.5 s more), and what verl-ext's commands import to draw and query a trace. vLLM:
#: verl's engine workers import ``vllm.distributed.utils`` where vLLM is installed
#: (checkpoint_engine/hccl_checkpoint_engine.py), and importing vLLM sets environment variables
#: (TORCHINDUCTOR_COMPILE_THREADS, ...): preloaded, a child whose parent imported vLLM has the
#: environment the server recorded after loading. Not vLLM's server modules (what verl's vLLM server
#: imports): they import ray. Not
#: tensordict and ray: they read, when imported, what verl sets when imported (LAZY_LEGACY_OP,
#: RAY_ENABLE_UV_RUN_RUNTIME_ENV); with ray preloaded, Ray's workers failed to start. Not polars: it
#: starts threads when imported.
PRELOADED = (
    "numpy", "torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers",
    "transformers.modeling_utils", "transformers.models.llama.modeling_llama", "datasets", "pandas", "pyarrow",
    "hydra", "omegaconf", "peft", "fastapi", "uvicorn", "aiohttp", "requests", "zmq", "duckdb", "matplotlib",
    "vllm.distributed.utils",  # see below
    # what importing verl's trainer brings besides verl, ray, tensordict and TransferQueue: `import verl.trainer.main_ppo`
    # in a child took 0.56 s of CPU without them, 0.49 s with them (not colorama: Ray's own copy, on the path it sets)
    "google.protobuf.json_format", "google.protobuf.text_format", "google.protobuf.timestamp_pb2", "jsonschema", "msgspec.json",
    "msgspec.msgpack", "msgspec.yaml", "msgspec.toml", "msgspec.inspect", "msgpack", "uvloop", "codetiming", "pdb",
    "tracemalloc", "packaging.requirements", "packaging.tags", "multiprocessing.managers", "multiprocessing.sharedctypes",
    "functorch.dim", "pyvers", "transformers.models.mistral.modeling_mistral",
)  # fmt: skip

#: Ray's shim that starts each worker of a job with a runtime environment (verl gives its jobs one): it sets the
#: environment's variables and execs the worker's command (``bash -c "exec <python> default_worker.py ..."``, which
#: comes back through the launcher). It runs in a server of its own, which loads only what the shim imports
#: (:data:`SHIM_PRELOADED`, Ray among it: the shim execs before Ray does anything): in the main server's children
#: it took about 0.2 s of CPU each, importing Ray, nine times in a run of verl's V1 trainer on Ray.
RAY_SHIM = os.path.join("ray", "_private", "workers", "setup_worker.py")
SHIM_PRELOADED = ("ray._private.runtime_env.context", "ray._private.ray_logging", "ray.core.generated.common_pb2")
SHIM_PREFIX = "shim-"

#: Interpreter options a child reproduces (``-W`` with its argument); with any other: a real interpreter.
CHILD_OPTIONS = ("-u", "-B", "-W")
#: Variables a child applies itself, PYTHONBREAKPOINT (read at each breakpoint() call: Ray's driver sets it in
#: a test's process, which then had every later command run fresh), and a terminal's size (set in some of the
#: harness's processes): they may differ from the server's.
CHILD_VARIABLES = {
    "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONFAULTHANDLER", "PYTHONBREAKPOINT",
    "COLUMNS", "LINES",
}  # fmt: skip
#: Variables native code may read while the libraries load, unseen by the recording of ``os.environ``.
NATIVE_PREFIXES = (
    "PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "TORCH_CPP_", "TORCH_SHOW_CPP_",
    "ATEN_CPU_CAPABILITY", "ONEDNN_", "DNNL_",  # which vector units torch's and oneDNN's kernels use
)  # fmt: skip

SOCKET_NAME, LAUNCHER_NAME, STATS_SUFFIX, LOG_NAME = "server.sock", "python", "stats.json", "server.log"
#: Set to ``1`` in a process whose ``multiprocessing`` children (spawned) may run in children of the server:
#: their parent is then the server, not the process that spawned them (by default they run in a real
#: interpreter, for a child that checks its parent: verl_ext.trace.parallel's workers).
SPAWNED_VARIABLE = "VERL_EXT_TEST_FORK_SPAWNED"
#: The launcher's path, for the pytest-xdist workers (they inherit the controller's environment).
LAUNCHER_VARIABLE = "VERL_EXT_TEST_LAUNCHER"
#: ``0``: no fork server; every interpreter the suite starts is a real one.
SWITCH_VARIABLE = "VERL_EXT_TEST_FORKSERVER"
DIRECTORY_PREFIX = "verl-ext-forkserver-"

_LENGTH = struct.Struct("!I")  # a request's length, before its pickle
_PID = struct.Struct("!i")  # after b"F": the child's pid, then its wait status

LAUNCHER = '''#!{python} -IS
"""Runs its command in a child of the test suite's fork server (tests/support/forkserver.py),
or in {python} when the server is gone or refuses it."""
import os, pickle, signal, socket, struct, sys


def real():
    os.execv({python!r}, [{python!r}, *sys.argv[1:]])


fds = []
for name in os.listdir("/proc/self/fd"):
    try:
        os.fstat(int(name))
        fds.append(int(name))
    except OSError:  # the listing's own descriptor, closed by now
        pass
mask = os.umask(0)
os.umask(mask)
request = pickle.dumps(dict(argv=sys.argv[1:], env=dict(os.environ), cwd=os.getcwd(), umask=mask, fds=fds))
path = {socket!r}
while True:
    try:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.connect(path)
        socket.send_fds(server, [struct.pack("!I", len(request)) + request], fds)
        answer = server.recv(1)
        if answer == b"S":  # the server for this command's hash seed
            path = os.path.join(os.path.dirname(path), server.recv(256).decode())
            server.close()
            continue
        if answer != b"F":
            raise OSError(answer)
        pid = struct.unpack("!i", server.recv(4, socket.MSG_WAITALL))[0]
        break
    except OSError:
        server.close()
        real()
for fd in fds:  # the child has them now; a pipe must see its end close when the child closes it
    os.close(fd)
for number in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM"):
    signal.signal(getattr(signal, number), lambda number, frame: os.kill(pid, number))
status = server.recv(4, socket.MSG_WAITALL)
if len(status) < 4:  # the server died
    os._exit(70)
status = struct.unpack("!i", status)[0]
if os.WIFSIGNALED(status):  # end by the same signal
    if os.WTERMSIG(status) not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(os.getpid(), os.WTERMSIG(status))
os._exit(os.waitstatus_to_exitcode(status))
'''


def launcher_path(directory: Path) -> Path:
    return Path(directory) / LAUNCHER_NAME


def real_python() -> str:
    """The real interpreter, also where ``sys.executable`` is the launcher (for a test that kills its
    interpreter with SIGKILL and reads what it left at once: a launcher's child dies a moment later)."""
    if Path(sys.executable).parent.name.startswith(DIRECTORY_PREFIX):
        return Path(sys.executable).read_text().splitlines()[0][2:].split()[0]  # the launcher's #! line
    return sys.executable


# --------------------------------------------------------------------------- the server


class _RecordedEnviron(os._Environ):
    """``os.environ`` that remembers the names read from it by name (shares os.environ's data).
    A value read after its name came from iterating over the environment (a copy of it, a scan for a
    prefix: tqdm, fsspec) is not recorded: what the reader asked for was the whole environment."""

    def __init__(self, environ: os._Environ, read: set[str]):
        super().__init__(environ._data, environ.encodekey, environ.decodekey, environ.encodevalue, environ.decodevalue)
        self._read = read
        self._iterated: collections.deque[str] = collections.deque()

    def __iter__(self):
        for key in super().__iter__():
            self._iterated.append(key)
            yield key

    def __getitem__(self, key):
        if key in self._iterated:
            while self._iterated.popleft() != key:
                pass
        else:
            self._read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._read.add(key)
        return super().__contains__(key)


def preload(modules: tuple[str, ...] = PRELOADED) -> set[str]:
    """Import ``modules``; return the environment variables they read (from ``os.environ``)."""
    read: set[str] = set()
    environ = os.environ
    os.environ = _RecordedEnviron(environ, read)
    try:
        for name in modules:
            importlib.import_module(name)
        if "transformers" in modules:
            # verl's get_hf_auto_model_class lists the configs of transformers' image-text-to-text models for
            # every model it builds (verl/utils/model.py), importing about 300 modules: 0.45 s a process
            importlib.import_module("transformers").AutoModelForImageTextToText._model_mapping.keys()
    finally:
        os.environ = environ
    return read


def split_options(argv: list[str]) -> tuple[list[str], list[str]]:
    """``python ARGV``'s interpreter options (``-W`` with its argument) and its command (``-c CODE ...``,
    ``-m MODULE ...``, ``SCRIPT ...``, or empty)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] not in ("-c", "-m", "-"):
        i += 2 if argv[i] == "-W" else 1
    return argv[:i], argv[i:]  # "-W" without its argument: no command


def refusal(request: dict, environments: tuple[dict[str, str], dict[str, str]], import_time: set[str]) -> str | None:
    """Why ``request`` must run in a real interpreter (None: a child runs it)."""
    env = request["env"]
    options, command = split_options(request["argv"])
    unknown = [option for option in options if option.startswith("-") and option not in CHILD_OPTIONS]
    if unknown:
        return f"the option {unknown[0]}"
    if not command or command[0] == "-":
        return "no command (an interactive interpreter or standard input)"
    if command[0] not in ("-c", "-m") and not os.path.isfile(os.path.join(request["cwd"], command[0])):
        return f"{command[0]} is not a file"
    if "--multiprocessing-fork" in command and env.get(SPAWNED_VARIABLE) != "1":
        return "a multiprocessing child"
    before, after = environments  # the server's, before and after the libraries loaded (a variable they set
    # themselves, a child may have from a parent that imported them)
    names = {n for n in set(env) | set(before) | set(after) if n in import_time or (n.startswith(NATIVE_PREFIXES) and n != "PYTHON")}
    differing = sorted(n for n in names - CHILD_VARIABLES if env.get(n) not in (before.get(n), after.get(n)))
    return f"its environment sets {', '.join(differing)} otherwise" if differing else None


def server_name(seed: str, shim: bool = False) -> str:
    """The socket of the server for commands with this hash seed ("random": the interpreter's own), or of Ray's shim's."""
    return f"{SHIM_PREFIX if shim else ''}seed-{seed}.sock"


class Server:
    """Serves on ``directory/name``. The main server (``SOCKET_NAME``) starts one server per hash seed
    a command asks for (``PYTHONHASHSEED``, which only an interpreter's start sets: verl's runs set it
    for their Ray workers) and sends those commands there."""

    def __init__(self, directory: Path, name: str = SOCKET_NAME, prestart: tuple[str, ...] = ()):
        self.directory, self.name = Path(directory), name
        self.seeded: dict[str, subprocess.Popen] = {}  # the main server's servers, by socket name
        environment = dict(os.environ)
        for seeded in prestart:  # their libraries load beside this server's (server_name)
            self._start(seeded, environment)
        self.base_path = sys.path[1:]  # without this script's directory, with PYTHONPATH's
        self.python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        # bound before the libraries load: a launcher that comes meanwhile waits in the backlog
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.directory / name))
        self.listener.listen(128)
        self.shim = name.startswith(SHIM_PREFIX)
        self.import_time = preload(SHIM_PRELOADED if self.shim else PRELOADED)
        self.environments = (environment, dict(os.environ))
        self.selector = selectors.DefaultSelector()
        self.children: dict[int, tuple[int, socket.socket | None]] = {}  # pidfd -> (pid, launcher)
        self.forked = 0
        self.refused: dict[str, int] = {}

    def serve(self) -> dict | None:
        """Serve until standard input closes (returns None), or, in a forked child, return its request."""
        listener = self.listener
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(sys.stdin, selectors.EVENT_READ, "lifeline")
        gc.collect()
        gc.freeze()  # the preloaded objects stay on pages the children share
        # this server's package, which a child imports anew: named once here rather than found by a scan of
        # sys.modules in each child (which wrote to about 2,500 pages it shared with the server)
        self.own_modules = [name for name in sys.modules if name == "tests" or name.startswith("tests.")]
        while True:
            for key, _ in self.selector.select():
                if key.data == "lifeline":
                    if not os.read(sys.stdin.fileno(), 4096):
                        self._stop()
                        return None
                elif key.data == "accept":
                    request = self._accept(listener)
                    if request is not None:
                        return request  # the child
                elif key.data == "launcher":  # readable: its launcher is gone (killed)
                    self._launcher_gone(key.fileobj)
                else:
                    self._reap(key.fileobj)

    def _accept(self, listener: socket.socket) -> dict | None:
        connection, _ = listener.accept()
        fds: list[int] = []
        try:
            data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 250)
            (length,) = _LENGTH.unpack_from(data)
            while len(data) < _LENGTH.size + length:
                chunk = connection.recv(1 << 20)
                if not chunk:
                    raise EOFError
                data += chunk
            request = pickle.loads(data[_LENGTH.size :])
            request["received"] = fds
        except (OSError, EOFError, struct.error, pickle.UnpicklingError):
            return _decline(connection, fds, b"")
        seed = request["env"].get("PYTHONHASHSEED", "random")
        seed = seed if seed.isdigit() else "random"
        command = split_options(request["argv"])[1]
        shim = bool(command) and command[0].endswith(os.sep + RAY_SHIM)
        if self.name == SOCKET_NAME and (shim or seed != "random"):
            return _decline(connection, fds, b"S" + self._seeded(seed, shim).encode())  # the launcher asks there
        # what the shim's server loaded does not reach the worker the shim execs
        why = refusal(request, self.environments, set() if self.shim else self.import_time)
        if why is not None:
            self.refused[why] = self.refused.get(why, 0) + 1
            return _decline(connection, fds, b"R")
        pid = os.fork()
        if pid == 0:
            self._close(listener, connection)
            return request
        try:
            os.setpgid(pid, pid)  # also here (the child sets it too): its launcher may die before the child runs
        except OSError:
            pass
        self.forked += 1
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, connection)
        self.selector.register(pidfd, selectors.EVENT_READ, "child")
        self.selector.register(connection, selectors.EVENT_READ, "launcher")
        connection.sendall(b"F" + _PID.pack(pid))
        return None

    def _seeded(self, seed: str, shim: bool = False) -> str:
        """The socket of the server with this hash seed ("random": the interpreter's own), Ray's shim's
        if ``shim``, started now if need be."""
        name = server_name(seed, shim)
        if name not in self.seeded:
            self._start(name, self.environments[0])
        _wait_for(self.directory / name, self.seeded[name])
        return name

    def _start(self, name: str, environment: dict[str, str]) -> None:
        """Start the server ``name`` (:func:`server_name`) in ``environment``, this server's before its libraries loaded."""
        seed = name.removeprefix(SHIM_PREFIX).removeprefix("seed-").removesuffix(".sock")
        env = {key: value for key, value in environment.items() if key != "PYTHONHASHSEED"}
        with open(self.directory / LOG_NAME, "ab") as log:
            self.seeded[name] = subprocess.Popen(
                [sys.executable, "-m", "tests.support.forkserver", str(self.directory), name], stdin=subprocess.PIPE,
                stdout=log, stderr=log, env={**env, **({"PYTHONHASHSEED": seed} if seed != "random" else {})},
            )  # fmt: skip

    def _close(self, listener: socket.socket, connection: socket.socket) -> None:
        """In a forked child: close what the server holds, before the child takes its descriptors."""
        self.selector.close()
        listener.close()
        connection.close()
        for pidfd, (_, launcher) in self.children.items():
            os.close(pidfd)
            if launcher is not None:
                launcher.close()
        self.children.clear()
        for server in self.seeded.values():
            server.stdin.close()  # its lifeline stays with the main server
        self.seeded.clear()

    def _launcher_gone(self, connection: socket.socket) -> None:
        self.selector.unregister(connection)
        for pidfd, (pid, launcher) in self.children.items():
            if launcher is connection:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.children[pidfd] = (pid, None)
        connection.close()

    def _reap(self, pidfd: int) -> None:
        pid, launcher = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if launcher is not None:
            self.selector.unregister(launcher)
            try:
                launcher.sendall(_PID.pack(status))
            except OSError:
                pass
            launcher.close()

    def _stop(self) -> None:
        for pid, _ in self.children.values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for server in self.seeded.values():
            server.stdin.close()
            server.wait()
        stats = json.dumps({"forked": self.forked, "refused": self.refused})
        (self.directory / f"{self.name}.{STATS_SUFFIX}").write_text(stats)

    # ----------------------------------------------------------------------- in the child

    def become(self, request: dict) -> None:
        """Turn this forked child into the interpreter the request asks for, up to running its code."""
        os.setpgid(0, 0)  # a group of its own: killed with its launcher, its own children with it
        self._descriptors(request)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        for number in range(1, signal.NSIG):
            try:
                signal.signal(number, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        signal.signal(signal.SIGINT, signal.default_int_handler)  # what a fresh interpreter installs
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        options, argv = split_options(request["argv"])
        env = request["env"]
        unbuffered = "-u" in options or bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = sys.__stdin__ = os.fdopen(0, "r", closefd=False) if _is_open(0) else None
        sys.stdout = sys.__stdout__ = _stream(1, unbuffered)
        sys.stderr = sys.__stderr__ = _stream(2, unbuffered)
        sys.dont_write_bytecode = "-B" in options or bool(env.get("PYTHONDONTWRITEBYTECODE"))
        sys.warnoptions[:] = [o for o in env.get("PYTHONWARNINGS", "").split(",") if o]
        sys.warnoptions += [options[i + 1] for i, o in enumerate(options) if o == "-W"]
        if sys.warnoptions:
            import warnings

            warnings._processoptions(sys.warnoptions)
        if env.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable()
        if "numpy" in sys.modules:  # seeded from the OS in a fresh interpreter
            sys.modules["numpy"].random.seed()
        if "torch" in sys.modules:  # torch's default generator too (else every child drew the server's numbers)
            sys.modules["torch"].seed()
        first = {"-c": "", "-m": os.getcwd()}.get(argv[0], os.path.dirname(os.path.realpath(argv[0])))
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        base = [p for p in self.base_path if p not in self.python_path]
        sys.path[:] = [first, *paths, *base]
        importlib.invalidate_caches()
        for name in self.own_modules:
            del sys.modules[name]  # this server's package: a child imports its own tests
        import tempfile

        tempfile.tempdir = None  # as before its first use: from the child's TMPDIR
        sys.executable = str(launcher_path(self.directory))
        if "multiprocessing.spawn" in sys.modules:  # imported by the server: it took the real interpreter then
            sys.modules["multiprocessing.spawn"].set_executable(sys.executable)

    def _descriptors(self, request: dict) -> None:
        """Give this process exactly the launcher's open file descriptors, at their numbers."""
        received = request.pop("received")
        moved = [_move_above(fd, 1024) for fd in received]
        keep = set(moved)
        for name in os.listdir("/proc/self/fd"):
            fd = int(name)
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        for high, number in zip(moved, request["fds"]):
            os.dup2(high, number, inheritable=True)
            os.close(high)


def _decline(connection: socket.socket, fds: list[int], answer: bytes) -> None:
    """Answer a launcher that no child of this server runs its command, and let go of its descriptors."""
    for fd in fds:
        os.close(fd)
    try:
        connection.sendall(answer)
    except OSError:
        pass
    connection.close()


def _move_above(fd: int, lowest: int) -> int:
    import fcntl

    high = fcntl.fcntl(fd, fcntl.F_DUPFD, lowest)
    os.close(fd)
    return high


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _stream(fd: int, unbuffered: bool):
    """Standard output or error on ``fd``, buffered as a fresh interpreter buffers it (pylifecycle.c)."""
    if not _is_open(fd):
        return None
    import io

    encoding = os.environ.get("PYTHONIOENCODING", "utf-8").split(":")[0] or "utf-8"
    raw = io.FileIO(fd, "w", closefd=False)
    errors = "backslashreplace" if fd == 2 else "strict"
    if unbuffered:
        return io.TextIOWrapper(raw, encoding=encoding, errors=errors, write_through=True)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding=encoding, errors=errors, line_buffering=raw.isatty() or fd == 2)


def run(request: dict) -> None:
    """Run the request's code as ``python ARGV`` would, in a fresh ``__main__``."""
    _, argv = split_options(request["argv"])
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec", dont_inherit=True), main.__dict__)
    elif argv[0] == "-m":
        import runpy

        sys.argv = ["-m", *argv[2:]]
        runpy._run_module_as_main(argv[1], alter_argv=True)
    else:
        path = argv[0]
        sys.argv = list(argv)
        main.__file__ = os.path.abspath(path)
        main.__cached__ = None
        with open(path, "rb") as source:
            code = compile(source.read(), path, "exec", dont_inherit=True)
        exec(code, main.__dict__)


# --------------------------------------------------------------------------- for tests/conftest.py


class Handle:
    """A running server: its launcher, and how to stop it."""

    def __init__(self, directory: Path, process):
        self.directory, self.process = directory, process
        self.launcher = launcher_path(directory)

    def stop(self) -> str:
        """Stop the servers (their children with them); say what they did."""
        self.process.stdin.close()
        self.process.wait(timeout=60)
        stats = [json.loads(path.read_text()) for path in self.directory.glob(f"*.{STATS_SUFFIX}")]
        if not stats:
            return f"stopped with {self.process.returncode}; see {self.directory / LOG_NAME}"
        import shutil

        shutil.rmtree(self.directory, ignore_errors=True)
        refused: dict[str, int] = {}
        for server in stats:
            for why, count in server["refused"].items():
                refused[why] = refused.get(why, 0) + count
        lines = [f"{sum(s['forked'] for s in stats)} interpreters forked from {len(stats)} preloaded servers, "
                 f"{sum(refused.values())} started fresh"]  # fmt: skip
        return "\n  ".join(lines + [f"{count} × {why}" for why, count in sorted(refused.items(), key=lambda item: -item[1])])


#: The servers a whole suite asks for besides the main one: verl's trainer sets PYTHONHASHSEED to the rollout's seed
#: (0, verl/trainer/main_ppo.py) for its Ray workers, which Ray starts through its shim. Started with the main server
#: (:func:`start`), their libraries load while the main server's do, on the core that would wait (about 6 s of CPU,
#: which the suite's first trainer run waited for while both cores were busy).
SUITE_SERVERS = (server_name("0"), server_name("random", shim=True))


def start(prestart: tuple[str, ...] = ()) -> Handle:
    """Start a server in a new directory, from this interpreter, in this environment, and with it the
    servers named in ``prestart`` (:data:`SUITE_SERVERS`), which it would otherwise start when first asked."""
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix=DIRECTORY_PREFIX))
    launcher = launcher_path(directory)
    launcher.write_text(LAUNCHER.format(python=sys.executable, socket=str(directory / SOCKET_NAME)))
    launcher.chmod(0o755)
    with open(directory / LOG_NAME, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.forkserver", str(directory), SOCKET_NAME, *prestart], stdin=subprocess.PIPE,
            stdout=log, stderr=log, start_new_session=True, cwd=Path(__file__).resolve().parents[2],  # the repository: tests/support/..
        )  # fmt: skip
    _wait_for(directory / SOCKET_NAME, process)
    return Handle(directory, process)


def _wait_for(path: Path, process: subprocess.Popen) -> None:
    """Until a server binds its socket (within a second or so: the libraries load after) or stops."""
    import time

    for _ in range(1000):
        if path.exists() or process.poll() is not None:
            return
        time.sleep(0.01)


def main(directory: str, name: str = SOCKET_NAME, *prestart: str) -> None:
    server = Server(Path(directory), name, prestart)
    assert threading.active_count() == 1, "a thread started while preloading: forking would copy it half-done"
    request = server.serve()
    if request is None:
        return
    server.become(request)
    del server
    server_modules = dict(sys.modules)
    interrupted = False
    try:
        run(request)
        status = 0
    except SystemExit as exit:
        status = _exit_status(exit)
    except (Exception, KeyboardInterrupt) as error:  # shown from the command's first frame, as a fresh interpreter shows it
        traceback = error.__traceback__
        while traceback is not None and traceback.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            traceback = traceback.tb_next
        sys.excepthook(type(error), error.with_traceback(traceback), traceback)
        status, interrupted = 1, isinstance(error, KeyboardInterrupt)
    finish(status, server_modules, interrupted)


def _exit_status(exit: SystemExit) -> int:
    """The status an interpreter exits with on an uncaught ``exit`` (printed when not a number)."""
    code = exit.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        print(code, file=sys.stderr)
    except Exception:
        pass
    return 1


def finish(status: int, server_modules: dict[str, types.ModuleType], interrupted: bool) -> None:
    """End the child as an interpreter's shutdown ends it (``Py_FinalizeEx``), but free only what the
    child made: its threads joined, ``atexit``'s functions, its files flushed, its own modules torn
    down (their objects' finalizers run, unclosed files closed), its standard streams flushed.
    Freeing the preloaded libraries too, as a fresh interpreter does, wrote to about 60,000 of the
    pages the child shares with the server (0.45 s of CPU, of about 200 children a suite)."""
    import atexit

    threading._shutdown()  # the non-daemon threads
    atexit._run_exitfuncs()
    # Files flushed while everything is whole: a module torn down leaves garbage cycles, and the garbage
    # collector may close a file's raw stream before the buffers above it (data a fresh interpreter keeps).
    _flush_files()
    # as the interpreter does: the modules nothing else holds go with the next collection; the others'
    # globals are cleared, the last imported module first, its private names before the rest
    own = [name for name, module in sys.modules.items() if server_modules.get(name) is not module]
    alive = [weakref.ref(module) for module in map(sys.modules.pop, reversed(own)) if isinstance(module, types.ModuleType)]
    gc.collect()
    for ref in alive:
        module = ref()
        if module is not None:
            names = [name for name in module.__dict__ if name != "__builtins__"]
            for name in sorted(names, key=lambda name: not (name.startswith("_") and not name.startswith("__"))):
                module.__dict__[name] = None
        del module
    gc.collect()
    if not _flush_files():
        status = 120  # an interpreter's status when it cannot flush its standard streams
    if interrupted:  # an uncaught KeyboardInterrupt: the interpreter ends by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _flush_files() -> bool:
    """Flush the child's open files (``gc.get_objects``: not the server's, frozen) and its standard
    streams; False when a standard stream could not be flushed."""
    flushed = True
    # a file is an object of a subclass of io.IOBase, asked once per type: ``isinstance`` on each object (an ABC's
    # check, about 500,000 objects in a child that imported verl's trainer) took 0.14 s of CPU there, in the first of two passes
    files: dict[type, bool] = {}
    for stream in [*gc.get_objects(), sys.stdout, sys.stderr]:
        kind = type(stream)
        is_file = files.get(kind)
        if is_file is None:
            is_file = files[kind] = issubclass(kind, io.IOBase)
        try:
            if is_file and not stream.closed and stream.writable():
                stream.flush()
        except Exception:
            flushed = flushed and stream is not sys.stdout and stream is not sys.stderr
    return flushed


if __name__ == "__main__":
    main(*sys.argv[1:])
