"""Inspect a trace from Python (a notebook needs no CLI).

    from verl_ext.inspect import open_trace, check_trace, sample_view, summarize, plots

    trace = open_trace("/runs/ppo/trace")          # lazy: reads _run.json and a listing
    trace.read_step(3)                             # pyarrow.Table; trace.to_pandas(3), trace.to_polars(3)
    report = check_trace(trace)                    # CheckReport: .passed, report["returns"], .to_arrow()
    sample_view(trace, 3, 0).table.to_pandas()     # the per-token table with decoded tokens
    summarize(trace).to_pandas()                   # one row per step
    compare(trace, step=3).statistics.to_pandas()  # every estimator re-estimated on step 3
    print(comparison_report(compare(trace, 3)))    # the text `verl-ext compare --step 3` prints
    critic_diagnostics(trace).to_pandas()          # the critic against the MC return, per step and position
    print(critic_report(critic_diagnostics(trace), gamma=0.99))  # `summary --critic`'s text (γ: the run's)
    by_staleness(trace).to_pandas()                # an asynchronous run: the update by staleness (`summary --by-staleness`)
    plots.advantage_heatmap(trace, 3, 0)           # matplotlib Figures (import matplotlib on use)
    connect(trace).sql("SELECT step, avg(advantage) FROM tokens WHERE mask GROUP BY step").df()  # DuckDB
    check_trace(trace, jobs=4)                     # the steps in 4 processes (summarize too; ray_address=...)

Every function takes an open trace or a path. The checker (``check_trace`` and its report, exported
here too) is in :mod:`verl_ext.check`; the step both read is :mod:`verl_ext.steps`'s. Modules:
``table`` (the per-token table, decoded tokens); ``summary`` (one row per step); ``offpolicy`` (the
off-policy numbers of a step, and by staleness in an asynchronous run); ``comparison`` (the
estimators side by side on one step); ``critic`` (the critic's values against the Monte-Carlo return,
by position); ``sql`` (DuckDB views over every table); ``unread`` (the steps a scan could not read: missing on disk, or whose files do not
read, and how the commands say so); ``plots``; ``render`` (text, CSV, Markdown, the check report,
progress lines). The commands are in :mod:`verl_ext.cli`.
"""

from __future__ import annotations

import importlib

from verl_ext import check as _check
from verl_ext.lazy_exports import lazy_exports

#: Public name -> module defining it. Imported on first use, so that ``import verl_ext.inspect``
#: loads nothing heavy.
_EXPORTS = {
    "open_trace": "verl_ext.trace.reader",
    "Trace": "verl_ext.trace.reader",
    **{name: "verl_ext.check" for name in _check.__all__},  # check_trace, CheckReport, what a check finds
    "sample_view": "verl_ext.inspect.table",
    "SampleView": "verl_ext.inspect.table",
    "summarize": "verl_ext.inspect.summary",
    "TokenDecoder": "verl_ext.inspect.table",
    "render": "verl_ext.inspect.render",
    "compare": "verl_ext.inspect.comparison",
    "Comparison": "verl_ext.inspect.comparison",
    "comparison_report": "verl_ext.inspect.comparison",
    "critic_diagnostics": "verl_ext.inspect.critic",
    "critic_report": "verl_ext.inspect.critic",
    "connect": "verl_ext.inspect.sql",
    "steps_by_bucket": "verl_ext.inspect.critic",
    "by_staleness": "verl_ext.inspect.offpolicy",
    "staleness_report": "verl_ext.inspect.offpolicy",
}
_names, _exported = lazy_exports(__name__, _EXPORTS)
__all__ = [*_names, "plots"]


def __getattr__(name: str):
    if name == "plots":
        return importlib.import_module("verl_ext.inspect.plots")
    return _exported(name)
