"""Synthetic captures and a fault-injecting filesystem for the trace tests."""

from __future__ import annotations

import threading
from typing import Callable

import fsspec
import numpy as np
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from verl_ext.trace.capture import StepCapture
from verl_ext.trace.schema import FLOAT_COLUMN_NAMES, RunRecord

# A small batch with every mask shape that matters: trailing padding, interior holes, a row with
# no valid token, a row valid to the end, a row whose only valid token is interior.
MASK = [
    [1, 1, 1, 0, 0, 0],
    [1, 0, 0, 1, 1, 0],
    [0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1],
    [0, 0, 1, 0, 0, 0],
]


def run_record(**fields) -> RunRecord:
    """A run record for tests that do not care about its content."""
    defaults = dict(
        verl_ext_version="0", verl_version="0", trainer="legacy", created_at="2025-01-01T00:00:00+00:00",
        algorithm={"adv_estimator": "mc", "gamma": 1.0, "lam": 1.0}, model_path=None, tokenizer_path=None,
        rollout_n=1, trace={},
    )  # fmt: skip
    return RunRecord(**{**defaults, **fields})


def make_capture(
    step: int = 1,
    mask=MASK,
    seed: int = 0,
    *,
    missing: tuple[str, ...] = (),
    dtype: torch.dtype = torch.float32,
    prompt_length: int = 4,
) -> StepCapture:
    """A capture with random float tensors (``missing`` columns set to None), left-padded prompts."""
    generator = torch.Generator().manual_seed(seed)
    response_mask = torch.tensor(mask, dtype=torch.int64)
    batch, length = response_mask.shape
    floats = {name: torch.randn(batch, length, generator=generator).to(dtype) for name in FLOAT_COLUMN_NAMES}
    prompt_lengths = torch.randint(1, prompt_length + 1, (batch,), generator=generator)
    prompt_mask = torch.arange(prompt_length)[None, :] >= (prompt_length - prompt_lengths)[:, None]
    fields = dict(
        step=step,
        mask=response_mask,
        token_id=torch.randint(0, 50_000, (batch, length), generator=generator),
        uid=np.array([f"group-{i // 2}" for i in range(batch)], dtype=object),
        prompts=torch.randint(1, 50_000, (batch, prompt_length), generator=generator) * prompt_mask,
        prompt_mask=prompt_mask.long(),
        kl_coef=0.05,
    )
    fields.update({name: None for name in missing if name in fields})
    floats.update({name: None for name in missing if name in floats})
    return StepCapture(floats=floats, **fields)


def reference_rows(capture, max_samples=None) -> list[dict]:
    """The token table written out by hand: one row per position up to each last valid token."""
    mask = capture.mask.tolist()
    kept = len(mask) if max_samples is None else min(len(mask), max_samples)
    rows = []
    for i in range(kept):
        valid = [t for t, flag in enumerate(mask[i]) if flag]
        for t in range(valid[-1] + 1 if valid else 0):
            row = {
                "sample": i,
                "uid": None if capture.uid is None else str(capture.uid[i]),
                "token_index": t,
                "token_id": None if capture.token_id is None else int(capture.token_id[i, t]),
                "mask": bool(mask[i][t]),
            }
            for column in FLOAT_COLUMN_NAMES:
                tensor = capture.floats.get(column)
                row[column] = None if tensor is None else float(np.float32(tensor[i, t].double().item()))
            rows.append(row)
    return rows


class HookedMemoryFileSystem(MemoryFileSystem):
    """memory:// with a hook called with the path at every write (to fail or stall writes).

    Its own store, so that tests do not see other memory:// files.
    """

    protocol = "hookedmem"
    store: dict = {}
    pseudo_dirs = [""]
    on_write: Callable[[str], None] | None = None

    def _open(self, path, mode="rb", **kwargs):
        file = super()._open(path, mode, **kwargs)
        hook = type(self).on_write  # through the class: a plain function, not a bound method
        if "w" in mode and hook is not None:
            file = _HookedFile(self, self._strip_protocol(path), hook)
            file.commit()
        return file


class _HookedFile(MemoryFile):
    def __init__(self, fs, path, hook):
        super().__init__(fs, path)
        self._hook = hook

    def write(self, data):
        written = super().write(data)
        self._hook(self.path)
        return written


fsspec.register_implementation(HookedMemoryFileSystem.protocol, HookedMemoryFileSystem, clobber=True)


def fail_writes_to(fragment: str, message: str = "disk full (injected)") -> Callable[[str], None]:
    """A write hook that raises OSError for temporary files of the given final path."""
    marker = fragment.replace("/", "~")

    def hook(path: str) -> None:
        if marker in path:
            raise OSError(message)

    return hook


class Gate:
    """A write hook that blocks writes of matching paths until ``open()``; counts waiters."""

    def __init__(self, fragment: str):
        self.marker = fragment.replace("/", "~")
        self.released = threading.Event()
        self.reached = threading.Event()

    def __call__(self, path: str) -> None:
        if self.marker in path:
            self.reached.set()
            assert self.released.wait(timeout=30), "gate never opened"

    def open(self) -> None:
        self.released.set()
