"""Synthetic captures and a fault-injecting filesystem for the trace tests."""

from __future__ import annotations

import threading
from typing import Callable

import fsspec
import numpy as np
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem

from verl_ext import registry
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
    rejected=None,
) -> StepCapture:
    """A capture with random float tensors (``missing`` columns set to None), left-padded prompts;
    ``rejected``: the tokens verl's rollout correction took out of ``mask``."""
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
    # the estimate's statistics, as the integration hands them over
    whitening = registry.whitening_statistics(floats["advantage_raw"], response_mask)
    rejected = None if rejected is None else torch.tensor(rejected, dtype=torch.bool)
    return StepCapture(floats=floats, whitening=whitening, rejected=rejected, **fields)


def reference_rows(capture, max_samples=None) -> list[dict]:
    """The token table written out by hand: one row per position up to each last token of the policy's
    own (valid, or rejected by verl's rollout correction: ``capture.rejected``)."""
    mask = capture.mask.tolist()
    rejected = None if capture.rejected is None else capture.rejected.tolist()
    own = [[bool(m) or bool(rejected and rejected[i][t]) for t, m in enumerate(row)] for i, row in enumerate(mask)]
    kept = len(mask) if max_samples is None else min(len(mask), max_samples)
    rows = []
    for i in range(kept):
        written = [t for t, flag in enumerate(own[i]) if flag]
        record = None if capture.agent_turns is None else capture.agent_turns[i]
        roles = [name for name, count in record["roles"] for _ in range(count)] if record else None
        for t in range(written[-1] + 1 if written else 0):
            row = {
                "sample": i,
                "uid": None if capture.uid is None else str(capture.uid[i]),
                "token_index": t,
                "token_id": None if capture.token_id is None else int(capture.token_id[i, t]),
                "mask": bool(mask[i][t]),
                "rejected": None if rejected is None else bool(rejected[i][t]),
                # the holes (runs of tokens the policy did not write, between two it did) that end before t
                "turn": sum(1 for u in range(1, t + 1) if own[i][u] and not own[i][u - 1] and any(own[i][:u])),
                # the model's tokens are the assistant's; a hole's, the agent loop's record's (else unknown)
                "role": "assistant" if own[i][t] else (roles[t] if roles else None),
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


def rewrite_in_the_old_layout(directory, version: int = 2) -> None:
    """Turn a trace this writer wrote into what verl-ext wrote for formats 1 and 2: each step's files
    named ``step=<n>`` (a hive partition: ``step`` only in the folder name, not in the token and update
    files), every file and the run record of schema ``version``. Version 1 also had no
    ``rollout_log_prob``, no end flags in the prompt table, no update tables, no ``update``/``host``
    in the run record. Neither had the turns (format 4) or the roles, tool calls and turn limits (format 5). Written out by hand, without the package's names, like an old trace on disk."""
    import json
    import re
    import shutil
    from pathlib import Path

    import pyarrow.parquet as pq

    root = Path(directory)
    old = lambda text: re.sub(r"step-(\d+)", r"step=\1", text)  # noqa: E731

    def rewrite(path: Path, drop: list[str]) -> None:
        table = pq.read_table(path)
        metadata = {k: old(v.decode()).encode() if k.startswith(b"verl_ext.") else v for k, v in table.schema.metadata.items()}
        metadata[b"verl_ext.schema_version"] = str(version).encode()
        target = root / old(str(path.relative_to(root)))
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.drop_columns([c for c in drop if c in table.column_names]).replace_schema_metadata(metadata), target)
        path.unlink()
        if path.parent != target.parent and not any(path.parent.iterdir()):
            path.parent.rmdir()

    for folder in ("_actor_update", "_critic_update"):
        if version == 1 and (root / folder).exists():
            shutil.rmtree(root / folder)
    for path in sorted(root.rglob("step-*/part-0.parquet")):
        rewrite(path, ["step", "turn", "role"] + (["rollout_log_prob"] if version == 1 else []))
    for path in sorted((root / "_prompts").glob("step-*.parquet")):
        rewrite(path, ["assistant_turns", "tool_calls", "turn_limit"] + (["response_length", "eos", "truncated"] if version == 1 else []))
    record = json.loads(old((root / "_run.json").read_text()))
    record["schema_version"] = version
    if version == 1:
        record = {key: value for key, value in record.items() if key not in ("update", "host")}
        for entry in record["steps"].values():
            entry.pop("updates", None)
    (root / "_run.json").write_text(json.dumps(record))
