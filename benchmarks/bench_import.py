"""Cost of the plugin on ``import verl``: with it (default) vs ``VERL_USE_EXTERNAL_PLUGINS=none``.

    .venv/bin/python benchmarks/bench_import.py [--runs 15]

Each measurement is a fresh interpreter timing ``import verl`` from inside (interpreter start-up
excluded); the two settings alternate so that machine noise hits both alike. Prints medians and
the ratio; the target is at most 1.10.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

# CPU time (user + system) of the import is reported next to wall time: it is far less sensitive
# to other processes competing for this machine's two cores.
CODE = """
import resource, time
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
wall, cpu0 = time.perf_counter(), cpu()
import verl
print(time.perf_counter() - wall, cpu() - cpu0)
"""


def import_seconds(plugins: str) -> tuple[float, float]:
    """(wall, cpu) seconds of ``import verl`` in a fresh interpreter."""
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": plugins}
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, check=True)
    wall, cpu = out.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    import_seconds("auto")  # warm the OS file cache
    with_plugin, without = [], []
    for _ in range(args.runs):
        with_plugin.append(import_seconds("auto"))
        without.append(import_seconds("none"))
    for i, label in enumerate(("wall", "cpu")):
        a = statistics.median(run[i] for run in with_plugin)
        b = statistics.median(run[i] for run in without)
        print(f"import verl, {label} median of {args.runs}: with verl-ext {a:.3f} s, without plugins {b:.3f} s, ratio {a / b:.3f}")


if __name__ == "__main__":
    main()
