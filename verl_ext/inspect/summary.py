"""One line of statistics per traced step, over valid tokens.

* ``samples``, ``tokens``: samples with at least one valid token, and their valid tokens
* ``score``, ``reward``: mean over samples of the sample's summed token scores / rewards
* ``kl``: mean kld_t per valid token (null when KL is not in the reward)
* ``value``, ``return``: means per valid token
* ``adv_raw_mean``, ``adv_raw_std``, ``adv_mean``, ``adv_std``: raw and trained-on advantage
  (std with n − 1, like masked_whiten, so a fully traced whitened step shows 1)
* ``explained_var``: 1 − Var(returns − values) / Var(returns), verl's ``critic/vf_explained_var``
* ``clip_low``, ``clip_high``, ``clip_dual``: fractions of the actor update's rows (all epochs)
  clipped low (A < 0), high (A > 0) and by the dual clip (null without update tables)
* ``adv_dlogp_corr``: correlation of the advantage with log_prob − old_log_prob in the last epoch:
  positive when the update raised the probability of the tokens it was told to raise
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import pyarrow as pa

from verl_ext.inspect.stepdata import Progress, StepData, as_trace
from verl_ext.inspect.update import update_statistics

SUMMARY_SCHEMA = pa.schema(
    [("step", pa.int64()), ("samples", pa.int64()), ("tokens", pa.int64())]
    + [
        (name, pa.float64())
        for name in (
            "score",
            "reward",
            "kl",
            "value",
            "return",
            "adv_raw_mean",
            "adv_raw_std",
            "adv_mean",
            "adv_std",
            "explained_var",
            "clip_low",
            "clip_high",
            "clip_dual",
            "adv_dlogp_corr",
        )
    ]
)
_COLUMNS = ("score", "reward", "kl", "value", "return", "advantage_raw", "advantage")


def summarize(trace, steps: Iterable[int] | None = None, progress: Progress | None = None) -> pa.Table:
    """SUMMARY_SCHEMA, one row per step (all traced steps, or ``steps``), read one step at a time."""
    trace = as_trace(trace)
    selected = list(trace.steps if steps is None else steps)
    rows, tokens = [], 0
    for done, step in enumerate(selected, start=1):
        data = StepData.read(trace, step, _COLUMNS)
        rows.append(step_summary(data) | update_statistics(trace, step))
        tokens += data.tokens
        if progress is not None:
            progress(done, len(selected), tokens)
    return pa.Table.from_pylist(rows, schema=SUMMARY_SCHEMA)


def step_summary(data: StepData) -> dict:
    col = data.columns
    layout = data.layout
    per_sample = layout.valid_sample_index()
    sampled = np.flatnonzero(layout.valid_counts)  # samples with at least one valid token

    def sample_mean(values: np.ndarray | None) -> float | None:
        if values is None or not len(sampled):
            return None
        return float(np.bincount(per_sample, weights=values, minlength=layout.samples)[sampled].mean())

    def mean(values: np.ndarray | None) -> float | None:
        return float(values.mean()) if values is not None and len(values) else None

    def std(values: np.ndarray | None) -> float | None:
        return float(values.std(ddof=1)) if values is not None and len(values) > 1 else None

    return {
        "step": data.step,
        "samples": layout.samples,
        "tokens": data.tokens,
        "score": sample_mean(col["score"]),
        "reward": sample_mean(col["reward"]),
        "kl": mean(col["kl"]),
        "value": mean(col["value"]),
        "return": mean(col["return"]),
        "adv_raw_mean": mean(col["advantage_raw"]),
        "adv_raw_std": std(col["advantage_raw"]),
        "adv_mean": mean(col["advantage"]),
        "adv_std": std(col["advantage"]),
        "explained_var": explained_variance(col["value"], col["return"]),
    }


def explained_variance(values: np.ndarray | None, returns: np.ndarray | None) -> float | None:
    """1 − Var(R − V)/Var(R); None without values or when the returns do not vary."""
    if values is None or returns is None or len(returns) < 2:
        return None
    spread = returns.var(ddof=1)
    return float(1.0 - (returns - values).var(ddof=1) / spread) if spread > 0 else None
