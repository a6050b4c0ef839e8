"""One step of a trace as numpy arrays.

* :class:`StepData`: a step's columns at its valid tokens (float64), with its :class:`StepLayout`;
* :class:`StepLayout`: from the long token table (one row per position, sorted by (sample,
  token_index), masked interior positions included) back to verl's padded rows, in dense row groups,
  so that the estimators (which skip masked positions themselves) can recompute a step without ever
  holding the whole padded batch;
* :func:`as_trace`: every inspection function takes an open trace or a path to one;
* :func:`floats` (a column as float numpy, NaN where null), :func:`join_keys` and :func:`locate`
  (the join of the update tables with the token table on (sample, token_index)).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import pyarrow as pa

from verl_ext.turns import first_of_each_turn, turn_index, turn_starts

#: Called by a scan after each step with (steps done, steps in all, valid tokens so far).
Progress = Callable[[int, int, int], None]


def as_trace(trace_or_path):
    """``trace_or_path`` if it is an open trace, else the trace opened at that path."""
    if isinstance(trace_or_path, (str, os.PathLike)):
        from verl_ext.trace.reader import open_trace

        return open_trace(os.fspath(trace_or_path))
    return trace_or_path


# --------------------------------------------------------------------------- a step as arrays


LAYOUT_COLUMNS = ("sample", "token_index", "mask", "rejected")


def floats(column: pa.ChunkedArray | pa.Array, dtype=np.float64) -> np.ndarray:
    """A numeric column as numpy values of ``dtype``, NaN where null (a null is not a number to
    compute with; where it matters, ``column.is_null()`` still tells it from a NaN)."""
    if column.null_count:
        column = column.fill_null(float("nan"))
    return np.asarray(column.to_numpy(zero_copy_only=False), dtype)


def join_keys(sample: np.ndarray, token_index: np.ndarray) -> np.ndarray:
    """(sample, token_index) as one int64 per row: the key an update table joins the token table on
    (within a step)."""
    return np.asarray(sample, np.int64) << 32 | np.asarray(token_index, np.int64)


def locate(keys: np.ndarray, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index into ``keys``, found) for each of ``wanted``: where each wanted key is in ``keys``
    (unique keys, sorted or not; the index is meaningless where not found)."""
    order = None if bool(np.all(keys[1:] > keys[:-1])) else np.argsort(keys, kind="stable")
    ordered = keys if order is None else keys[order]
    if not len(keys):
        return np.zeros(len(wanted), np.int64), np.zeros(len(wanted), bool)
    at = np.minimum(np.searchsorted(ordered, wanted), len(keys) - 1)
    found = ordered[at] == wanted
    return (at if order is None else order[at]), found


@dataclass
class StepData:
    step: int
    table: pa.Table
    layout: StepLayout
    #: float64 values at the valid tokens (NaN where null); None for a column that is null everywhere.
    columns: dict[str, np.ndarray | None]

    @classmethod
    def read(cls, trace, step: int, columns: Sequence[str], rows_only: Sequence[str] = ()) -> "StepData":
        """``columns`` as float64 at the valid tokens; ``rows_only`` only in ``table``."""
        table = trace.read_step(step, columns=[*LAYOUT_COLUMNS, *columns, *rows_only])
        return cls.from_table(step, table, columns)

    @classmethod
    def from_table(cls, step: int, table: pa.Table, columns: Sequence[str], layout: "StepLayout | None" = None) -> "StepData":
        """``columns`` of a token table; ``layout``: the table's, when already made."""
        layout = StepLayout.of(table) if layout is None else layout
        values = {}
        for name in columns:
            column = table.column(name)
            if column.null_count == len(column) and len(column):
                values[name] = None
            else:
                values[name] = floats(column)[layout.valid_rows]
        return cls(step, table, layout, values)

    @property
    def tokens(self) -> int:
        """Number of valid tokens."""
        return len(self.layout.valid_rows)

    def estimate(
        self, estimator, settings: Mapping[str, Any], truncation: Callable[[np.ndarray], Any] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(returns, raw advantage) at the valid tokens, recomputed from this step's reward and value
        with a registered estimator (verl_ext.registry.run, the code path of training), in float64,
        one dense row group at a time. ``truncation(samples)``: the
        :class:`~verl_ext.truncation.Truncation` of the samples (layout indices) of a row group; None:
        terminal."""
        import torch

        from verl_ext import registry

        reward, value = self.columns["reward"], self.columns.get("value")
        returns, raw = np.empty(self.tokens), np.empty(self.tokens)
        for group in self.layout.row_groups():
            result = registry.run(
                estimator,
                torch.from_numpy(group.dense(reward)),
                None if value is None else torch.from_numpy(group.dense(value)),
                torch.from_numpy(group.mask()),
                settings,
                whiten=False,
                truncation=None if truncation is None else truncation(group.samples),
            )
            returns[group.tokens] = group.gather(result.returns.numpy())
            raw[group.tokens] = group.gather(result.advantage_raw.numpy())
        return returns, raw

    def at_own_tokens(self, name: str) -> np.ndarray | None:
        """Column ``name`` of :attr:`table` at the policy's own tokens (valid or rejected, in row order;
        float64, NaN where null); None for a column null everywhere."""
        column = self.table.column(name)
        if column.null_count == len(column):
            return None
        return floats(column.cast("float64") if column.type == pa.bool_() else column)[self.layout.own_rows]

    def location(self, valid_token: int) -> tuple[int, int]:
        """(sample, token_index) of a valid token."""
        return self.row_location(int(self.layout.valid_rows[valid_token]))

    def row_location(self, row: int) -> tuple[int, int]:
        """(sample, token_index) of a row of the step table."""
        layout = self.layout
        return int(layout.sample_ids[layout.row_sample[row]]), int(layout.token_index[row])

    def is_null(self, name: str, valid_token: int) -> bool:
        return not self.table.column(name)[int(self.layout.valid_rows[valid_token])].is_valid

    def nonfinite(self, names: Sequence[str]) -> dict[str, np.ndarray]:
        """name -> the valid tokens (indices) where that column is null or not finite, for each of
        ``names`` the step has (a column null everywhere is left out: it is absent, not broken)."""
        return {name: np.flatnonzero(~np.isfinite(self.columns[name])) for name in names if self.columns.get(name) is not None}


# --------------------------------------------------------------------------- layout


#: A dense row group holds at most this many cells (rows × longest row): bounded memory per step.
GROUP_CELLS = 1 << 21


class LayoutProblem(NamedTuple):
    row: int  # the first offending row of the step table
    message: str
    count: int  # offending rows of this kind


@dataclass(frozen=True)
class RowGroup:
    """Some samples of a step as dense (rows, width) arrays; valid token ``tokens[i]`` of the step
    sits at flat cell ``cells[i]`` = row × width + its position among its sample's rows (which is
    its token_index in a well-formed trace)."""

    samples: np.ndarray  # (R,) sample indices (0 … B-1) of the rows
    width: int
    tokens: np.ndarray  # (N,) indices into the step's valid tokens
    cells: np.ndarray  # (N,) flat dense cell of each of them

    def dense(self, values: np.ndarray) -> np.ndarray:
        """(R, width) float64: ``values`` (one per valid token of the step) at their cells, 0 elsewhere."""
        out = np.zeros(len(self.samples) * self.width)
        out[self.cells] = values[self.tokens]
        return out.reshape(len(self.samples), self.width)

    def mask(self) -> np.ndarray:
        """(R, width) float64: 1 at valid tokens, 0 elsewhere."""
        out = np.zeros(len(self.samples) * self.width)
        out[self.cells] = 1.0
        return out.reshape(len(self.samples), self.width)

    def gather(self, dense: np.ndarray) -> np.ndarray:
        """The entries of a (R, width) array at this group's valid tokens, in the order of ``tokens``."""
        return dense.reshape(-1)[self.cells]


class StepLayout:
    """Samples and valid tokens of one step's token table."""

    @classmethod
    def of(cls, table: pa.Table) -> "StepLayout":
        """The layout of a token table (of its LAYOUT_COLUMNS; a table without ``rejected``, or with it
        null, rejected nothing)."""
        rejected = table.column("rejected") if "rejected" in table.column_names else None
        return cls(
            table.column("sample").to_numpy(),
            table.column("token_index").to_numpy(),
            table.column("mask").to_numpy(zero_copy_only=False),
            None if rejected is None or rejected.null_count == len(rejected) else rejected.fill_null(False).to_numpy(zero_copy_only=False),
        )

    @classmethod
    def read(cls, trace, step: int) -> "StepLayout":
        """The layout of a step, reading its LAYOUT_COLUMNS only."""
        return cls.of(trace.read_step(step, list(LAYOUT_COLUMNS)))

    def __init__(self, sample: np.ndarray, token_index: np.ndarray, mask: np.ndarray, rejected: np.ndarray | None = None):
        """``mask``: the tokens the estimate and the update used (the valid tokens); ``rejected``: the
        policy's tokens verl's rollout correction took out of it (None: none)."""
        n = len(sample)
        starts_here = np.ones(n, dtype=bool)
        starts_here[1:] = sample[1:] != sample[:-1]
        self.starts = np.flatnonzero(starts_here)
        self.row_counts = np.diff(np.append(self.starts, n))
        self.sample_ids = sample[self.starts]
        self.row_sample = np.cumsum(starts_here) - 1  # sample index (0 … B-1) of every row
        self.position = np.arange(n) - self.starts[self.row_sample]
        self.token_index = token_index
        self.mask = mask
        self.rejected = rejected
        #: the policy's own tokens: the valid ones and the rejected ones (a rejection is not a hole)
        self.own = mask if rejected is None else mask | rejected
        self.valid_rows = np.flatnonzero(mask)
        valid_sample = self.row_sample[self.valid_rows]
        self.valid_counts = np.bincount(valid_sample, minlength=len(self.starts))  # L of each sample
        self.valid_starts = np.concatenate(([0], np.cumsum(self.valid_counts)[:-1]))

    @property
    def samples(self) -> int:
        return len(self.starts)

    @cached_property
    def own_rows(self) -> np.ndarray:
        """Row indices of the policy's own tokens (valid or rejected), in row order."""
        return np.flatnonzero(self.own)

    @cached_property
    def own_counts(self) -> np.ndarray:
        """Per sample (0 … B-1), its own tokens (the valid ones where nothing was rejected)."""
        return np.bincount(self.row_sample[self.own_rows], minlength=self.samples)

    @cached_property
    def row_turn_starts(self) -> np.ndarray:
        """(rows,) bool: the first token of an assistant turn (docs/definitions.md §7), i.e. its
        sample's first token of the policy's or one right after a hole (a rejected token is the
        policy's: :attr:`own`)."""
        starts = turn_starts(self.own)
        # the rows run on from one sample to the next: a sample's first row starts a turn when it is
        # the policy's, whatever the sample before it ended with
        starts[self.starts] = self.own[self.starts] != 0
        return starts

    @cached_property
    def turn_starts(self) -> np.ndarray:
        """(N,) bool at the valid tokens: the first valid token of each assistant turn (a turn whose
        first tokens were rejected starts at its first valid one)."""
        if self.rejected is None:
            return self.row_turn_starts[self.valid_rows]
        return first_of_each_turn(self.row_sample[self.valid_rows], self.row_turns()[self.valid_rows])

    def row_turns(self) -> np.ndarray:
        """(rows,) int64: the assistant turn of every row, holes included (the turn before the hole;
        0 before the policy's first token), from the policy's own tokens alone."""
        begins = self.row_turn_starts
        index = turn_index(begins)  # counted over the whole step, so each sample is shifted back
        begun_before_sample = np.repeat(index[self.starts] + 1 - begins[self.starts], self.row_counts)
        return np.maximum(index - begun_before_sample, 0)

    @cached_property
    def valid_position(self) -> np.ndarray:
        """(rows,) int64: each row's index among the valid tokens (into ``valid_rows``), −1 at a masked row."""
        position = np.full(len(self.mask), -1, np.int64)
        position[self.valid_rows] = np.arange(len(self.valid_rows))
        return position

    def valid_sample_index(self) -> np.ndarray:
        """Sample index (0 … B-1) of every valid token."""
        return np.repeat(np.arange(self.samples), self.valid_counts)

    def sample_sums(self, values: np.ndarray) -> np.ndarray:
        """Per sample (0 … B-1), the sum of ``values`` (one per valid token) over its valid tokens."""
        return np.bincount(self.valid_sample_index(), weights=values, minlength=self.samples)

    def samples_among(self, valid_tokens: np.ndarray) -> np.ndarray:
        """Per sample (0 … B-1), True when one of ``valid_tokens`` (indices of valid tokens) is its."""
        flagged = np.zeros(self.samples, bool)
        flagged[self.valid_sample_index()[valid_tokens]] = True
        return flagged

    def index_of(self, sample_ids: np.ndarray) -> np.ndarray:
        """Index (0 … B-1) of each of ``sample_ids`` in the step, −1 for a sample the step lacks."""
        index, found = locate(self.sample_ids.astype(np.int64), np.asarray(sample_ids, np.int64))
        return np.where(found, index, -1)

    def rows_of(self, indices: Sequence[int]) -> np.ndarray:
        """Row indices of the samples at ``indices`` (0 … B-1), in that order."""
        pieces = [np.arange(self.starts[i], self.starts[i] + self.row_counts[i]) for i in indices]
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)

    def problems(self) -> Iterator[LayoutProblem]:
        """Rows that break the layout the trace format promises, one entry per kind of break."""
        unsorted = self.starts[1:][np.diff(self.sample_ids) <= 0]
        if len(unsorted):
            yield LayoutProblem(int(unsorted[0]), "samples are not sorted, or a sample's rows are split", len(unsorted))
        gap = np.flatnonzero(self.token_index != self.position)
        if len(gap):
            row = int(gap[0])
            message = f"token_index {self.token_index[row]} where {self.position[row]} was due (rows run 0…n−1)"
            yield LayoutProblem(row, message, len(gap))
        last_rows = self.starts + self.row_counts - 1
        padded = last_rows[~self.own[last_rows]]
        if len(padded):
            message = "the sample's rows end on a masked token (they must stop at the policy's last token)"
            yield LayoutProblem(int(padded[0]), message, len(padded))

    def row_groups(self, cells: int = GROUP_CELLS) -> Iterator[RowGroup]:
        """Dense groups of samples of similar length, each at most ``cells`` cells (one row at least)."""
        widths = self.row_counts
        order = np.argsort(widths, kind="stable")
        begin = 0
        while begin < len(order):
            end = begin + 1  # widths ascend along ``order``: the group's width is its last row's
            while end < len(order) and (end + 1 - begin) * widths[order[end]] <= cells:
                end += 1
            yield self._group(order[begin:end])
            begin = end

    def _group(self, samples: np.ndarray) -> RowGroup:
        counts = self.valid_counts[samples]
        first = np.repeat(self.valid_starts[samples], counts)
        offset = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        tokens = first + offset
        width = int(self.row_counts[samples].max())
        row = np.repeat(np.arange(len(samples)), counts)
        return RowGroup(samples, width, tokens, row * width + self.position[self.valid_rows[tokens]])
