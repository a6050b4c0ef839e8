"""The model of a traced step, shared by everything that reads one: the checker, the inspection,
the view and the apps.

Modules: ``layout`` (a step as arrays: its rows back to verl's padded batch, in dense row groups);
``recorded`` (what the run record says about how the trace was made: the estimator and its settings,
whether the run finished, the rollout engine); ``cuts`` (the responses cut at the length limit, and
the estimators under each ``algorithm.truncation``); ``update_rows`` (the update tables' rows, joined
to the token table). It reads traces (:mod:`verl_ext.trace`) and imports nothing above it.
"""
