"""One function over many steps of a trace, in parallel: in worker processes on this machine
(``jobs``), or as Ray tasks on a cluster whose nodes all read the trace at the same path or URL.

``fn(trace, step) -> (value, tokens)`` is a module-level function (workers import it by name); each
worker opens the trace once and reads one step at a time, so its memory is one step's (the checker's:
about 420 bytes per token row of its largest step) on top of the libraries it imports (about 300 MB
with torch; docs/performance.md#many-steps-at-once). :func:`map_steps` yields (step, value) in the
order of ``steps``, whatever order the workers finish in, so a command's output is the serial run's. A step whose file does not read comes back as
its :class:`~verl_ext.errors.StepFileError` in place of the value. Ctrl-C stops every worker: worker
processes are terminated, Ray tasks cancelled; a worker process or Ray worker that dies is a
:class:`~verl_ext.errors.WorkerLost`; worker processes end with a parent killed outright (Linux).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable, Iterator, Sequence

from verl_ext.errors import StepFileError, UsageError, WorkerLost

StepFn = Callable[[Any, int], tuple[Any, int]]
Progress = Callable[[int, int, int], None]
#: Below this many token rows in all the steps asked for, workers cost more to start than they save (two
#: spawned workers importing torch at once took about 3 s on 2 cores, while one process checks about
#: 3.3 M rows/s and two about 6 M/s: break-even near 25 M rows, benchmarks/bench_check.py), and the
#: steps run in this process.
MIN_PARALLEL_ROWS = 30_000_000


def default_jobs() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def map_steps(
    trace,
    steps: Sequence[int],
    fn: StepFn,
    *,
    jobs: int = 1,
    ray_address: str | None = None,
    progress: Progress | None = None,
) -> Iterator[tuple[int, Any]]:
    """(step, ``fn(trace, step)``'s value, or the step's StepFileError) for each of ``steps`` in their
    order; ``progress(done, total, tokens)`` after each step. ``jobs`` > 1: that many worker processes
    (serial below :data:`MIN_PARALLEL_ROWS`); ``ray_address``: Ray tasks on that cluster ("auto": the
    one ``RAY_ADDRESS`` names or this machine runs)."""
    if jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {jobs}")
    if ray_address is not None:
        outcomes = _on_ray(trace.path, steps, fn, ray_address)
    elif jobs > 1 and len(steps) > 1 and _rows(trace, steps) >= MIN_PARALLEL_ROWS:
        outcomes = _in_processes(trace.path, steps, fn, min(jobs, len(steps)))
    else:
        outcomes = (_outcome(trace, fn, step) for step in steps)
    yield from _in_order(outcomes, steps, progress)


def _rows(trace, steps: Sequence[int]) -> int:
    entries = trace.record.steps
    return sum(entries[str(step)].rows for step in steps if str(step) in entries)


def _in_order(outcomes, steps: Sequence[int], progress: Progress | None) -> Iterator[tuple[int, Any]]:
    """The outcomes as they finish, handed on in ``steps`` order."""
    waiting: dict[int, Any] = {}
    position, tokens = 0, 0
    for done, (step, value, step_tokens) in enumerate(outcomes, start=1):
        waiting[step] = value
        tokens += step_tokens
        if progress is not None:
            progress(done, len(steps), tokens)
        while position < len(steps) and steps[position] in waiting:
            yield steps[position], waiting.pop(steps[position])
            position += 1


def _outcome(trace, fn: StepFn, step: int) -> tuple[int, Any, int]:
    try:
        value, tokens = fn(trace, step)
    except StepFileError as error:
        return step, error, 0
    return step, value, tokens


# --------------------------------------------------------------------------- worker processes

_opened: dict[str, Any] = {}


def _in_worker(fn: StepFn, path: str, step: int) -> tuple[int, Any, int]:
    trace = _opened.get(path)
    if trace is None:
        from verl_ext.trace.reader import open_trace

        trace = _opened[path] = open_trace(path)
    return _outcome(trace, fn, step)


def _share_cores(threads: int) -> None:
    """torch's and Arrow's threads in this worker: its share of the cores, rather than every worker
    starting a thread per core."""
    import pyarrow

    torch = sys.modules.get("torch")
    if torch is None:  # taken by torch when the step's function imports it (not imported here: about 2 s)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    elif torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if pyarrow.cpu_count() != threads:
        pyarrow.set_cpu_count(threads)


def _start_worker(parent: int, threads: int) -> None:
    """A worker process's start: it ends with its parent, then takes its share of the cores."""
    _end_with_parent(parent)
    _share_cores(threads)


def _end_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent ends (Linux's PR_SET_PDEATHSIG): a parent killed outright
    (``kill -9``, the out-of-memory killer) would leave its workers waiting for steps forever, each
    holding its memory. Elsewhere, nothing."""
    import ctypes
    import ctypes.util

    try:
        prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    PR_SET_PDEATHSIG = 1
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the line above
        os._exit(1)


def _in_processes(path: str, steps: Sequence[int], fn: StepFn, jobs: int) -> Iterator[tuple[int, Any, int]]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    # Spawned, not forked: the parent holds Arrow's and torch's threads. An executor, not a Pool: a
    # Pool replaces a worker that dies and waits forever for its step; the executor says it broke.
    executor = ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker, initargs=(os.getpid(), max(1, default_jobs() // jobs)),
    )
    # The workers start within the first submits, with Ctrl-C ignored, which they keep from their
    # first instruction: the parent stops them, and none prints a traceback.
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        futures = [executor.submit(_in_worker, fn, path, step) for step in steps]
    finally:
        signal.signal(signal.SIGINT, interrupt)
    try:
        for future in as_completed(futures):
            yield future.result()
    except BrokenProcessPool:
        raise WorkerLost(
            "a worker process ended before returning its step (killed, e.g. out of memory: each holds one step, "
            "about 420 bytes per token row; fewer jobs use less memory). From a script, call this under "
            '`if __name__ == "__main__":`: each spawned worker imports the script\'s module.'
        ) from None
    except BaseException:
        # Python 3.14's terminate_workers(); before it, the executor's own list of its processes
        for process in list(getattr(executor, "_processes", {}).values()):
            process.terminate()
        raise
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------- Ray tasks


def _on_ray(path: str, steps: Sequence[int], fn: StepFn, address: str) -> Iterator[tuple[int, Any, int]]:
    if "://" not in path and not os.path.isabs(path):
        path = os.path.abspath(path)  # the tasks' working directory is not this one
    try:
        import ray
    except ImportError:
        raise UsageError("--ray needs Ray (pip install ray)") from None
    started = not ray.is_initialized()
    if started:
        _require_listening(address)
        try:
            # "auto": the cluster RAY_ADDRESS names, else a new one on this machine
            ray.init(address=None if address == "auto" else address, logging_level="ERROR", log_to_driver=False)
        except ConnectionError as error:
            raise UsageError(f"--ray: no Ray cluster at {address} ({error})") from None
    from ray.exceptions import LocalRayletDiedError, NodeDiedError, OutOfMemoryError, WorkerCrashedError

    # One CPU each, Ray's default. Not retried: a step's function is deterministic, and a task whose
    # worker died (killed, out of memory) would die again, three times by Ray's default, before the error.
    task = ray.remote(max_retries=0)(_in_ray_task)
    step_of = {}
    for step in steps:
        step_of[task.remote(fn, path, step)] = step
    pending = list(step_of)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                outcome = ray.get(ready[0])
            except (WorkerCrashedError, OutOfMemoryError, NodeDiedError, LocalRayletDiedError) as error:
                raise WorkerLost(
                    f"a Ray worker ended before returning step {step_of[ready[0]]} ({type(error).__name__}: killed, e.g. "
                    "out of memory: each holds one step, about 420 bytes per token row)"
                ) from None
            yield outcome
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    finally:
        if started:
            ray.shutdown()


def _in_ray_task(fn: StepFn, path: str, step: int) -> tuple[int, Any, int]:
    _share_cores(1)
    return _in_worker(fn, path, step)


def _require_listening(address: str) -> None:
    """A UsageError when nothing listens at ``address`` (host:port, or ray://host:port), at once: Ray
    itself retries a dead address for minutes."""
    import socket

    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except (OSError, ValueError) as error:
        raise UsageError(f"--ray: no Ray cluster at {address} ({error})") from None
