"""Memory for the training thread's copies of a step (:func:`verl_ext.trace.capture.take_snapshot`):
blocks recycled from written steps, and consecutive arrays carved out of one block."""

from __future__ import annotations

import threading

import numpy as np
import torch


class SnapshotMemory:
    """Recycles the memory of snapshots that were written, for the next ones (thread-safe).

    A snapshot is ~80 MB at 512 × 4096; copying into fresh memory page-faults all of it, which
    measured 20-50 ms per submit on a busy machine, more than the copies themselves. A block is
    only created when none is free, so there are never more blocks than the most snapshots alive
    at once (queue_size + 2 in a writer: queued, being written, being submitted).
    """

    def __init__(self):
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 block of at least ``nbytes``: a free one, or a new one (free ones too small are dropped)."""
        with self._lock:
            while self._free:
                block = self._free.pop()
                if block.numel() >= nbytes:
                    return block
        return torch.empty(nbytes, dtype=torch.uint8)

    def give_back(self, block: torch.Tensor) -> None:
        """Return a block; nothing may use the snapshot it held any more."""
        with self._lock:
            self._free.append(block)


ALIGNMENT = 64  # bytes; keeps every array of a block aligned for vectorized copies


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def block_bytes(arrays: dict[str, tuple[torch.Tensor | None, torch.dtype]], shape: tuple[int, int] | None) -> int:
    """Block bytes for the present ``arrays`` at (rows, columns) ``shape``."""
    return sum(aligned(shape[0] * shape[1] * dtype.itemsize) for tensor, dtype in arrays.values() if tensor is not None)


class Block:
    """Carves consecutive arrays out of one uint8 block."""

    def __init__(self, memory: torch.Tensor):
        self.memory = memory
        self._used = 0

    def copy(self, tensor: torch.Tensor | None, shape: tuple[int, int] | None, dtype: torch.dtype) -> np.ndarray | None:
        """``tensor[:rows, :cols]`` converted to ``dtype``, copied into the block, as a numpy array."""
        if tensor is None:
            return None
        rows, cols = shape
        nbytes = rows * cols * dtype.itemsize
        array = self.memory[self._used : self._used + nbytes].view(dtype).view(rows, cols)
        self._used += aligned(nbytes)
        return array.copy_(tensor[:rows, :cols]).numpy()
