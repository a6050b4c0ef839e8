"""One step of a trace as numpy arrays over its valid tokens, the form every inspection computes on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa

from verl_ext.inspect.layout import StepLayout

LAYOUT_COLUMNS = ("sample", "token_index", "mask")


@dataclass
class StepData:
    step: int
    table: pa.Table
    layout: StepLayout
    #: float64 values at the valid tokens (NaN where null); None for a column that is null everywhere.
    columns: dict[str, np.ndarray | None]

    @classmethod
    def read(cls, trace, step: int, columns: Sequence[str]) -> "StepData":
        table = trace.read_step(step, columns=[*LAYOUT_COLUMNS, *columns])
        return cls.from_table(step, table, columns)

    @classmethod
    def from_table(cls, step: int, table: pa.Table, columns: Sequence[str]) -> "StepData":
        layout = StepLayout(
            table.column("sample").to_numpy(),
            table.column("token_index").to_numpy(),
            table.column("mask").to_numpy(zero_copy_only=False),
        )
        values = {}
        for name in columns:
            column = table.column(name)
            if column.null_count == len(column) and len(column):
                values[name] = None
            else:
                values[name] = column.to_numpy().astype(np.float64)[layout.valid_rows]
        return cls(step, table, layout, values)

    @property
    def tokens(self) -> int:
        """Number of valid tokens."""
        return len(self.layout.valid_rows)

    def location(self, valid_token: int) -> tuple[int, int]:
        """(sample, token_index) of a valid token."""
        return self.row_location(int(self.layout.valid_rows[valid_token]))

    def row_location(self, row: int) -> tuple[int, int]:
        """(sample, token_index) of a row of the step table."""
        layout = self.layout
        return int(layout.sample_ids[layout.row_sample[row]]), int(layout.token_index[row])

    def is_null(self, name: str, valid_token: int) -> bool:
        return not self.table.column(name)[int(self.layout.valid_rows[valid_token])].is_valid
