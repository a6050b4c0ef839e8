"""Run torch's CPU ops on the calling thread alone for a moment."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Set torch's intra-op threads to 1 inside the block, and restore them afterwards.

    For memory-bound work on cache-sized pieces (the trace snapshot, the checker's recomputation),
    intra-op threads gain little, and they collapse when the cores are shared with the trainer's
    other processes: on a busy 2-core machine the trace snapshot took ~150 ms with 2 threads and
    ~15 ms with one, and the checker's recomputation was ~20x slower with 2 threads.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
