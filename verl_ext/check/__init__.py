"""The checker: every identity of docs/definitions.md §8 on every traced step, and the report as data.

    from verl_ext.check import check_trace
    report = check_trace("/runs/ppo/trace")        # CheckReport: .passed, .verdict, report["returns"], .to_arrow()

For: recomputing what a trace records and saying where it disagrees, within stated tolerances.
Not for: tables, summaries, comparisons, plots or rendering; those are :mod:`verl_ext.inspect`'s,
which may import this package (never the other way round). The commands are in :mod:`verl_ext.cli`.

Modules: ``identities`` (the identities of docs/definitions.md §8, one record each); ``results``
(what a check finds, the one comparison, tolerances); ``token_checks`` (the token table's checks,
recomputation and tolerances); ``update_checks`` (the update tables' checks and statistics); ``run``
(runs them all, the report as data). The step they read (its layout, the recorded run, the cut
responses, the update rows) is :mod:`verl_ext.steps`'s.
"""

from __future__ import annotations

from verl_ext.lazy_exports import lazy_exports

#: Public name -> module defining it, imported on first use: ``import verl_ext.check`` loads nothing heavy.
__all__, __getattr__ = lazy_exports(__name__, {
    **dict.fromkeys(["check_trace", "CheckReport"], "verl_ext.check.run"),
    **dict.fromkeys(["IdentityResult", "StepResult", "Violation", "Location"], "verl_ext.check.results"),
})
