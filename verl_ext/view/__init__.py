"""The browser view of a trace (``verl-ext view``): every token of a response coloured by a chosen
quantity, every number of a token on hover, the step's summary, the estimators side by side and the
check's findings.

    from verl_ext.view import write_page, serve

    write_page("RUN", "run.html", step=40, sample=3)   # one self-contained page (no network needed)
    server = serve("RUN", port=0)                       # the whole trace from 127.0.0.1, read lazily
    print(server.url); server.serve_forever()

Modules: ``payload`` (a trace's steps and samples as the page's data: the numbers come from
:mod:`verl_ext.check`, :mod:`verl_ext.inspect` and the trace reader), ``page`` (the HTML page: which
steps go into a file, the data inlined safely), ``server`` (the local read-only server), ``static/``
(the page's style and its script, in modules run in ``page.SCRIPTS``' order, inlined into every page).
"""

from __future__ import annotations

from verl_ext.lazy_exports import lazy_exports

#: Public name -> module defining it, imported on first use: ``import verl_ext.view`` loads nothing heavy.
__all__, __getattr__ = lazy_exports(__name__, {
    "write_page": "verl_ext.view.page",
    "select_steps": "verl_ext.view.page",
    "serve": "verl_ext.view.server",
    "ViewServer": "verl_ext.view.server",
})
