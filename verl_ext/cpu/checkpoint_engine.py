"""A checkpoint engine that runs on a CPU: the trainer's weights reach a rollout on its own workers
through a file in shared memory.

verl 0.9.1's asynchronous trainers (V1 ``separate_async``, one-step-off-policy, fully async) keep the
rollout on workers of its own and send it the trainer's weights after each update through a
*checkpoint engine* (:class:`verl.checkpoint_engine.CheckpointEngine`). verl registers ``naive`` (only
for a rollout in the trainer's own process), and ``nccl``, ``nixl``, ``delta_sharded`` (cupy and a GPU),
``hccl``, ``kimi``, ``mooncake`` (absent); none runs on a CPU-only machine. This one does, on one
machine: the trainer's rank 0 writes every tensor, as it comes, into a file under ``/dev/shm`` (else
the temporary directory), then an index of them, by an atomic rename; each rollout worker waits for
the index and reads the tensors back one at a time, bit for bit, as a plain generator (verl-ext's
HF-generate adapter reads its weights with a ``for``; verl's vLLM adapter takes a generator or an
async iterator alike).

Selected as verl lets a module register a backend::

    actor_rollout_ref.rollout.checkpoint_engine.backend=verl_ext_shm
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=verl_ext.cpu.checkpoint_engine

(verl imports that module in the trainer's actor workers, the rollout's checkpoint-engine workers and
the manager before it asks its registry for the backend; the CPU backend also registers it when verl's
``verl.checkpoint_engine`` is imported: a record of :data:`verl_ext.touches.CPU_TOUCHES`).
``verl_ext.cpu.overrides.async_overrides`` sets both for the asynchronous modes. Options, through
``checkpoint_engine.engine_kwargs.verl_ext_shm``: ``directory`` (where the exchange folders go) and
``timeout_s`` (how long a rollout worker waits for the trainer's weights).

One exchange per weight update, as verl drives every engine (``CheckpointEngineManager.update_weights``):
``prepare`` on every worker (rank 0 makes a fresh folder), ``build_topology`` (every worker on rank 0's
machine, or one line saying which is not), ``init_process_group`` (the folder to every worker),
``send_weights`` on the trainer's ranks and ``receive_weights`` on the rollout's at once, ``finalize``
(rank 0 removes the folder: every rollout worker has read it by then).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Generator

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

#: ``actor_rollout_ref.rollout.checkpoint_engine.backend`` of this engine.
BACKEND = "verl_ext_shm"
#: What ``...checkpoint_engine.custom_backend_module`` names: this module.
MODULE = __name__

DATA_FILE = "weights.bin"
INDEX_FILE = "index.json"  # written last, by a rename: its presence says the data file is whole
FAILED_FILE = "failed"  # the sender's error, one line, when it could not write the weights
FOLDER_PREFIX = "verl_ext_weights_"
#: Shared memory when the machine has it (a tmpfs: no disk write), else the temporary directory.
DEFAULT_PARENT = "/dev/shm"
DEFAULT_TIMEOUT_S = 600.0
POLL_SECONDS = 0.005


class CheckpointEngineError(RuntimeError):
    """A weight exchange that cannot be done; its message is one line."""


class SharedMemoryCheckpointEngine(CheckpointEngine):
    """verl's checkpoint-engine interface over a folder of this machine's shared memory.

    ``is_master``: the trainer's rank 0, the one writer (verl passes it to the trainer's engines only;
    the rollout's are readers). ``bucket_size`` is verl's and unused: nothing is staged in buckets.
    """

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int = 0,
        is_master: bool = False,
        directory: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.parent = directory
        self.timeout_s = float(timeout_s)
        self.folder: Path | None = None  # this exchange's folder, from init_process_group
        self._made: Path | None = None  # the folder this (master) engine made, for finalize to remove

    # ---- the topology: one folder, one machine ----

    def prepare(self) -> dict[str, Any]:
        metadata: dict[str, Any] = {"host": socket.gethostname(), "folder": None}
        if self.is_master:
            self._remove_made()  # an exchange that never reached finalize (a failed step)
            self._made = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=_parent(self.parent)))
            metadata["folder"] = str(self._made)
        return metadata

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        # verl's manager lists the trainer's workers first, rank 0 first (CheckpointEngineManager.build_process_group)
        master = metadata[0]
        if master.get("folder") is None:
            raise CheckpointEngineError(f"checkpoint engine {BACKEND}: the trainer's rank 0 did not prepare an exchange folder")
        elsewhere = sorted({m["host"] for m in metadata if m["host"] != master["host"]})
        if elsewhere:
            raise CheckpointEngineError(
                f"checkpoint engine {BACKEND} passes the weights through one machine's shared memory, and the "
                f"trainer's rank 0 is on {master['host']} while workers are on {', '.join(elsewhere)}: run the "
                "trainer and the rollout on one machine"
            )
        actor = {"folder": [master["folder"]] * actor_wg_world_size, "rank": list(range(actor_wg_world_size))}
        rollout = {"folder": [master["folder"]] * rollout_world_size, "rank": [-1] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, folder: str, rank: int = -1, **unused) -> None:
        self.folder = Path(folder)
        self.rank = rank

    def finalize(self) -> None:
        self._remove_made()
        self.folder = None

    def _remove_made(self) -> None:
        if self._made is not None:
            shutil.rmtree(self._made, ignore_errors=True)
            self._made = None

    # ---- the exchange ----

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None):
        """Rank 0 writes each tensor's bytes as it comes, then the index; every other trainer rank walks
        the generator only (producing each full tensor is collective over the trainer's ranks)."""
        if not self.is_master:
            for _ in weights:
                pass
            return {}
        folder = self._exchange_folder()
        try:
            write_weights(folder, weights, global_steps)
        except BaseException as error:
            _write_atomically(folder / FAILED_FILE, _one_line(error))
            raise
        return {}

    def receive_weights(self, global_steps: int | None = None) -> Generator[tuple[str, torch.Tensor], None, None]:
        """The trainer's tensors, in its order, each read when asked for (a plain generator). Waits for
        the trainer's index first (up to ``timeout_s``)."""
        folder = self._exchange_folder()
        index = wait_for_index(folder, self.timeout_s)
        if global_steps is not None and index.get("global_steps") not in (None, global_steps):
            raise CheckpointEngineError(
                f"checkpoint engine {BACKEND}: the rollout asked for the weights of step {global_steps} and "
                f"{folder} holds those of step {index['global_steps']}"
            )
        yield from read_weights(folder, index)

    def _exchange_folder(self) -> Path:
        if self.folder is None:
            raise CheckpointEngineError(
                f"checkpoint engine {BACKEND}: send or receive before init_process_group (verl's CheckpointEngineManager calls it first)"
            )
        return self.folder


# ---------------------------------------------------------------------------- the files


def write_weights(folder: Path, weights, global_steps: int | None = None) -> dict[str, Any]:
    """Each tensor's bytes into ``folder/weights.bin``, one after another as the generator yields them,
    then ``folder/index.json`` (name, dtype, shape, offset of each) by a rename. Returns the index."""
    entries = []
    offset = 0
    with open(folder / DATA_FILE, "wb") as data:
        for name, tensor in weights:
            tensor = tensor.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            tensor = tensor.contiguous()
            raw = tensor.reshape(-1).view(torch.uint8)  # the bytes as they are: any dtype, NaN payloads kept
            data.write(memoryview(raw.numpy()))
            entries.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, raw.numel()])
            offset += raw.numel()
    index = {"global_steps": global_steps, "bytes": offset, "tensors": entries}
    _write_atomically(folder / INDEX_FILE, json.dumps(index))
    return index


def wait_for_index(folder: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """The index the trainer wrote into ``folder``, once it is there; the trainer's error if it failed."""
    deadline = time.monotonic() + timeout_s
    while True:
        failed = folder / FAILED_FILE
        if failed.exists():
            raise CheckpointEngineError(f"checkpoint engine {BACKEND}: the trainer could not write its weights: {failed.read_text().strip()}")
        try:
            return json.loads((folder / INDEX_FILE).read_text())
        except FileNotFoundError:
            pass
        if not folder.exists():
            raise CheckpointEngineError(f"checkpoint engine {BACKEND}: the exchange folder {folder} is gone (the trainer's rank 0 removed it or never made it here)")
        if time.monotonic() >= deadline:
            raise CheckpointEngineError(
                f"checkpoint engine {BACKEND}: no weights from the trainer in {folder} after {timeout_s:g} s "
                f"(checkpoint_engine.engine_kwargs.{BACKEND}.timeout_s)"
            )
        time.sleep(POLL_SECONDS)


def read_weights(folder: Path, index: dict[str, Any]) -> Generator[tuple[str, torch.Tensor], None, None]:
    """The tensors of ``index`` from ``folder/weights.bin``, each in a buffer of its own, one at a time."""
    with open(folder / DATA_FILE, "rb") as data:
        for name, dtype_name, shape, offset, nbytes in index["tensors"]:
            dtype = getattr(torch, dtype_name)
            if nbytes == 0:
                yield name, torch.empty(shape, dtype=dtype)
                continue
            buffer = bytearray(nbytes)
            data.seek(offset)
            if data.readinto(buffer) != nbytes:
                raise CheckpointEngineError(f"checkpoint engine {BACKEND}: {folder / DATA_FILE} ends inside {name}")
            yield name, torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".part")
    temporary.write_text(text)
    os.replace(temporary, path)


def _parent(directory: str | None) -> str | None:
    """Where an exchange folder goes: the configured directory, else shared memory, else the temporary directory."""
    if directory:
        return directory
    return DEFAULT_PARENT if os.path.isdir(DEFAULT_PARENT) and os.access(DEFAULT_PARENT, os.W_OK) else None


def _one_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def register(registry: type = CheckpointEngineRegistry) -> None:
    """Put the engine in verl's registry under :data:`BACKEND` (idempotent)."""
    if registry._registry.get(BACKEND) is not SharedMemoryCheckpointEngine:
        registry.register(BACKEND)(SharedMemoryCheckpointEngine)


register()  # verl imports this module by custom_backend_module before it looks the backend up
