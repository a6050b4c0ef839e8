"""What every task's asset spec holds: the fields that determine the content of a task's assets and
name its cache directory (:func:`verl_ext.tasks.common.cached_build`).

Each task's ``AssetSpec`` (:mod:`verl_ext.tasks.arith.assets`, :mod:`verl_ext.tasks.tool.assets`)
is this dataclass with its own fields added (its warm start's settings, its format number). The key
hashes the field values only, sorted by name: which class declares a field changes no key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import ClassVar


@dataclass(frozen=True)
class TaskAssetSpec:
    """Everything that determines the content of the assets (hashed into the cache key): the tiny
    ``llama`` (:func:`verl_ext.tasks.common.tiny_llama`) and the problems. A task's spec adds its own
    fields; every field must have a default, and a JSON value (``asdict``)."""

    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    #: Put before the hash in the key, so that the tasks' cache directories tell them apart.
    KEY_PREFIX: ClassVar[str] = ""
    #: A wrong ``c`` is ``a+b+d`` with ``1 <= |d| <= max_delta``.
    max_delta: int = 3
    val_problems: int = 60
    train_rows: int = 2048

    def key(self) -> str:
        """The cache directory's name: KEY_PREFIX, then 12 hex digits of the SHA-256 of the field values."""
        return self.KEY_PREFIX + hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]
