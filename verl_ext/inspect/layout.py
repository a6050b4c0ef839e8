"""From a step's long token table back to verl's padded (B, T) rows, and forth.

A trace step has one row per response position of each sample, from token 0 to the sample's
last valid token, sorted by (sample, token_index); interior masked positions are rows with
mask=false. ``StepLayout`` finds the samples in that table and lays their valid tokens into
dense row groups, so that the estimators of :mod:`verl_ext.estimators` (which skip masked
positions themselves) can recompute a step without ever holding the whole padded batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np

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

    def __init__(self, sample: np.ndarray, token_index: np.ndarray, mask: np.ndarray):
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
        self.valid_rows = np.flatnonzero(mask)
        valid_sample = self.row_sample[self.valid_rows]
        self.valid_counts = np.bincount(valid_sample, minlength=len(self.starts))  # L of each sample
        self.valid_starts = np.concatenate(([0], np.cumsum(self.valid_counts)[:-1]))

    @property
    def samples(self) -> int:
        return len(self.starts)

    def valid_sample_index(self) -> np.ndarray:
        """Sample index (0 … B-1) of every valid token."""
        return np.repeat(np.arange(self.samples), self.valid_counts)

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
        padded = last_rows[~self.mask[last_rows]]
        if len(padded):
            message = "the sample's rows end on a masked token (they must stop at its last valid token)"
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
