"""One update table of a step as numpy arrays, read the one way every reader of the update tables
needs it: its columns (floats NaN where null), its rows by (epoch, sample), and per row whether PPO
clipped the token and whether one of its numbers is not finite.

The update identities (:mod:`verl_ext.check.update_checks`), ``show --epoch`` (:mod:`verl_ext.inspect.table`),
the plots' most clipped step and the browser view (:mod:`verl_ext.view.payload`) read the update
tables through :class:`UpdateRows`, so a row's epoch, its clip and its flags mean one thing in all of them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from verl_ext.steps.layout import floats
from verl_ext.trace.schema import CLIP_CODES, CLIP_NONE

#: The columns that place a row: which token it trained, and in which PPO epoch.
ROW_KEYS = ("sample", "token_index", "epoch")
#: The clip codes that name a clip region (a null or unknown code is not one).
CLIPPED_CODES = tuple(code for code in CLIP_CODES if code != CLIP_NONE)


class UpdateRows:
    """The rows of one update table (``table``: any of its columns, ROW_KEYS among them)."""

    def __init__(self, table: pa.Table):
        self.table = table
        self.sample = table.column("sample").to_numpy()
        self.token_index = table.column("token_index").to_numpy()
        self.epoch = table.column("epoch").to_numpy()
        # rows by (epoch, sample): the writer's order already, so sorting is only a fallback
        key = self.epoch.astype(np.int64) << 32 | self.sample.astype(np.int64)
        self._order = None if bool(np.all(key[1:] >= key[:-1])) else np.argsort(key, kind="stable")
        self._key = key if self._order is None else key[self._order]

    @classmethod
    def read(cls, trace, kind: str, step: int, columns: Sequence[str] | None = None) -> "UpdateRows":
        """The update table of ``kind`` at ``step``: ``columns`` (default all) and ROW_KEYS."""
        names = None if columns is None else [*ROW_KEYS, *(name for name in columns if name not in ROW_KEYS)]
        return cls(trace.update_table(kind, step, names))

    @property
    def count(self) -> int:
        return self.table.num_rows

    def epochs(self) -> list[int]:
        return sorted(int(epoch) for epoch in np.unique(self.epoch))

    def arrays(self) -> dict[str, np.ndarray | None]:
        """name -> the column as numpy (floats as float64, NaN where null); None for a column null
        everywhere (absent from the run, not broken)."""
        return {name: _numpy(self.table.column(name)) for name in self.table.column_names}

    def of(self, samples: Sequence[int], epoch: int) -> np.ndarray:
        """Row indices of ``samples`` in ``epoch``, sample by sample, each in the table's order."""
        picked = []
        for sample in samples:
            wanted = np.int64(epoch) << 32 | np.int64(sample)
            lo, hi = np.searchsorted(self._key, [wanted, wanted + 1])
            picked.append(np.arange(lo, hi) if self._order is None else self._order[lo:hi])
        return np.concatenate(picked) if picked else np.zeros(0, np.int64)

    def clipped(self) -> np.ndarray:
        """Per row: its clip code names a clip region (docs/definitions.md §8); all False without a
        ``clip`` column (the critic's table)."""
        if "clip" not in self.table.column_names:
            return np.zeros(self.count, bool)
        inside = pc.is_in(self.table.column("clip"), value_set=pa.array(CLIPPED_CODES))
        return inside.fill_null(False).to_numpy(zero_copy_only=False)

    def nonfinite(self) -> np.ndarray:
        """Per row: one of its float columns is null or not finite there (a column null everywhere
        is left out: it is absent, not broken)."""
        flagged = np.zeros(self.count, bool)
        for name in self.table.column_names:
            column = self.table.column(name)
            if pa.types.is_floating(column.type) and not (column.null_count == len(column) and len(column)):
                flagged |= ~np.isfinite(floats(column))
        return flagged


def _numpy(column: pa.ChunkedArray) -> np.ndarray | None:
    if column.null_count == len(column) and len(column):
        return None
    return floats(column) if pa.types.is_floating(column.type) else column.to_numpy(zero_copy_only=False)
