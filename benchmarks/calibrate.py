"""A fixed, deterministic CPU workload whose seconds turn a wall time taken on a busy or unknown
machine into a ratio (docs/performance.md gives the demos' times as "N× calibrate").

    .venv/bin/python benchmarks/calibrate.py

One thread. Half of it is torch (a two-layer MLP's forward and backward on float32 matrices, the
kind of arithmetic the CPU demo does), half plain Python (building small dicts and lists and
formatting strings, the kind of work verl's driver does between the tensors). It runs the workload
once to warm up, then three times, and prints the median in seconds.
"""

from __future__ import annotations

import statistics
import time

import torch

#: The workload's size; changing any of these makes every ratio measured before incomparable.
BATCH, WIDTH, HIDDEN = 128, 256, 512
TORCH_ITERATIONS = 400
PYTHON_ITERATIONS = 400_000
TIMED_RUNS = 3


def torch_part(generator: torch.Generator) -> None:
    inputs = torch.randn(BATCH, WIDTH, generator=generator)
    first = torch.randn(WIDTH, HIDDEN, generator=generator, requires_grad=True)
    second = torch.randn(HIDDEN, WIDTH, generator=generator, requires_grad=True)
    for _ in range(TORCH_ITERATIONS):
        output = torch.relu(inputs @ first) @ second
        output.square().mean().backward()


def python_part() -> int:
    checksum = 0
    for i in range(PYTHON_ITERATIONS):
        record = {"step": i, "name": f"k{i % 97}", "values": [i, i + 1, i + 2]}
        checksum += len(record["name"]) + sum(record["values"]) % 7
    return checksum


def seconds_of_one_run() -> float:
    generator = torch.Generator().manual_seed(0)  # the same matrices on every run
    start = time.perf_counter()
    torch_part(generator)
    python_part()
    return time.perf_counter() - start


def main() -> None:
    torch.set_num_threads(1)  # one core's speed, whatever else shares the machine's cores
    seconds_of_one_run()  # warm-up: torch's first kernels and allocations
    print(f"{statistics.median(seconds_of_one_run() for _ in range(TIMED_RUNS)):.3f}")


if __name__ == "__main__":
    main()
