"""The page of the browser view: one HTML file with its script, style and data inline.

:func:`write_page` writes a self-contained page of a trace (``verl-ext view TRACE --out FILE``);
:func:`render_page` is the HTML around any data, also what the server sends (with only the run's
description inline: the script then asks the server for each step).

Which steps go into a file (:func:`select_steps`): the ``steps`` asked for, or every step when the
trace holds at most ``max_tokens`` token rows; else the starting step first, then steps spread evenly
over the run (the first and the last, then the middle, the quarters, …) while they fit in
``max_tokens``. A step larger than the budget left keeps its first samples only, the starting sample
and its group (same uid) always, and the page says how many it left out. A step costs about 150 bytes
per token row (per PPO epoch of update tables, about 40 more), so the default budget of
:data:`DEFAULT_MAX_TOKENS` rows keeps a page near 30 MB. Every step in a file has its summary,
comparison and check computed over all of its samples.

Data goes into the page as JSON in a ``<script type="application/json">`` element with every ``<``,
``>`` and ``&`` escaped (``\\u003c`` …), so no string of the trace (a token, a prompt, a path) can
close the element or open another; the script shows every string as text (``textContent``), never
as markup. The page's Content-Security-Policy allows its own inline script and style only (by a
per-page nonce), and no network access at all. The script is the files of :data:`SCRIPTS`
concatenated in that order into one element, so that the page needs no build step and no request.
"""

from __future__ import annotations

import html
import json
import os
import secrets
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Callable, Sequence

from verl_ext.errors import UsageError

#: Token rows a page holds by default (about 30 MB): see the module docstring.
DEFAULT_MAX_TOKENS = 200_000
#: Element id of the inline data.
DATA_ID = "verl-ext-data"
#: The viewer's script files under ``static/``, in the order the page runs them: each adds to one
#: namespace object (``window.verlExtViewer``) what the later ones use.
SCRIPTS = (
    "viewer_state.js", "viewer_dom.js", "viewer_data.js", "viewer_colour.js", "viewer_versions.js",
    "viewer_glyphs.js", "viewer_render.js", "viewer.js",
)
_ESCAPES = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026", 0x2028: "\\u2028", 0x2029: "\\u2029"}


@dataclass(frozen=True)
class Selection:
    """What a page holds: its steps in order, and per step the samples kept when not all of them."""

    steps: tuple[int, ...]
    #: step -> the samples kept, for a step cut to fit the budget
    cut: dict[int, list[int]] = field(default_factory=dict)


def step_rows(trace, step: int) -> int:
    """Token rows of a step, from the run record's index (its footer when the index lacks it); 0 for a
    step whose footer does not read, which the page then leaves out (:func:`page_data`)."""
    from verl_ext.errors import StepFileError

    entry = trace.record.steps.get(str(step))
    if entry is not None:
        return int(entry.rows)
    try:
        return int(trace.step_record(step).rows)
    except StepFileError:
        return 0


def spread(steps: Sequence[int]) -> list[int]:
    """``steps`` in the order a page takes them: the first and the last, then the middle, the
    quarters, the eighths, … (each step once)."""
    n = len(steps)
    if n == 0:
        return []
    order: list[int] = [0, n - 1]
    parts = 2
    while len(set(order)) < n:
        order += [round(i * (n - 1) / parts) for i in range(1, parts, 2)]
        parts *= 2
        if parts > 2 * n:
            order += list(range(n))
    return [steps[i] for i in dict.fromkeys(order)]


def select_steps(
    trace,
    start: int,
    steps: Sequence[int] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    keep: Callable[[int], list[int]] | None = None,
) -> Selection:
    """The steps of a page (module docstring). ``start``: the step shown first; ``keep(step)``: the
    samples a cut step must keep in order (the starting sample and its group), given only for
    ``start``'s step."""
    if steps is not None:
        for step in steps:
            trace.require_step(step)
        candidates = [start, *[s for s in steps if s != start]]
    else:
        total = sum(step_rows(trace, step) for step in trace.steps)
        candidates = [start, *[s for s in (trace.steps if total <= max_tokens else spread(trace.steps)) if s != start]]
    left = max_tokens
    chosen: list[int] = []
    cut: dict[int, list[int]] = {}
    for step in candidates:
        rows = step_rows(trace, step)
        if rows <= left:
            chosen.append(step)
            left -= rows
        elif step == start or steps is not None:
            samples = _samples_within(trace, step, left, keep(step) if keep is not None and step == start else [])
            if samples:
                chosen.append(step)
                cut[step] = samples
                left -= sum(_sample_rows(trace, step).get(s, 0) for s in samples)
    return Selection(tuple(sorted(chosen)), cut)


def _sample_rows(trace, step: int) -> dict[int, int]:
    from verl_ext.steps.layout import StepLayout

    layout = StepLayout.read(trace, step)
    return dict(zip(layout.sample_ids.tolist(), layout.row_counts.tolist()))


def _samples_within(trace, step: int, budget: int, first: list[int]) -> list[int]:
    """``first``, then the step's samples in order, as many as fit in ``budget`` rows (``first`` always)."""
    rows = _sample_rows(trace, step)
    kept = [s for s in dict.fromkeys(first) if s in rows]
    used = sum(rows[s] for s in kept)
    for sample, count in rows.items():
        if sample in kept:
            continue
        if used + count > budget:
            break
        kept.append(sample)
        used += count
    return sorted(kept)


# --------------------------------------------------------------------------- the page


def _asset(name: str) -> str:
    return resources.files("verl_ext.view").joinpath("static", name).read_text(encoding="utf-8")


def viewer_script() -> str:
    """The viewer's script as the page holds it: :data:`SCRIPTS` concatenated in their order."""
    return "\n".join(_asset(name) for name in SCRIPTS)


def inline_json(data) -> str:
    """``data`` as JSON that is safe inside a ``<script type="application/json">`` element."""
    return json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")).translate(_ESCAPES)


def render_page(data: dict, title: str) -> str:
    """The HTML page: the viewer's style and script inline, ``data`` inline as JSON with
    :func:`~verl_ext.view.payload.page_schema` (so that the script names and shows the columns, the
    summary's fields and the quantities as their records say)."""
    from verl_ext.view.payload import page_schema

    data = {**data, **page_schema()}
    nonce = secrets.token_urlsafe(18)
    connect = "'self'" if data.get("mode") == "served" else "'none'"  # a file page fetches nothing at all
    policy = f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'nonce-{nonce}'; connect-src {connect}; img-src data:; base-uri 'none'; form-action 'none'"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(title)}</title>\n"
        f'<style nonce="{nonce}">\n{_asset("viewer.css")}</style>\n</head>\n<body>\n'
        f"{_asset('viewer.html')}"
        f'<script type="application/json" id="{DATA_ID}">{inline_json(data)}</script>\n'
        f'<script nonce="{nonce}">\n{viewer_script()}</script>\n</body>\n</html>\n'
    )


def page_data(
    trace, start_step: int, start_sample: int | None, selection: Selection, decoder, progress=None, unread=None,
    *, jobs: int = 1, ray_address: str | None = None,
) -> dict:  # fmt: skip
    """The data of a self-contained page: the run, and per step of ``selection`` its overview, its
    tokens and its statistics, with the summary and the check of those steps (read in ``jobs``
    processes or as Ray tasks: :func:`verl_ext.trace.parallel.map_steps`). A step whose files do
    not read is left out of the page and noted in ``unread`` (:class:`UnreadSteps`), which the page's
    notes say with the missing steps."""
    from verl_ext.check.run import check_trace
    from verl_ext.inspect.summary import summarize
    from verl_ext.inspect.unread import UnreadSteps
    from verl_ext.view.payload import StepSource, check_failures, check_not_checked, clean, run_info

    unread = UnreadSteps.of(trace) if unread is None else unread
    parallel = {"jobs": jobs, "ray_address": ray_address}
    summary = {row["step"]: row for row in summarize(trace, selection.steps, unread=unread, **parallel).to_pylist()}
    readable = [step for step in selection.steps if step not in unread.unreadable]
    report = check_trace(trace, readable, **parallel)
    steps = {}
    tokens = 0
    for done, (step, source) in enumerate(unread.read(readable, lambda step: StepSource(trace, step, decoder)), start=1):
        overview = source.overview()
        chunk = source.chunk(selection.cut.get(step))
        steps[str(step)] = {
            "overview": overview,
            "chunk": chunk,
            "statistics": source.statistics(summary.get(step), report),
            "cut": step in selection.cut,
        }
        tokens += overview["valid"]
        if progress is not None:
            progress(done, len(readable), tokens)
    shown = [step for step in selection.steps if str(step) in steps]
    run = run_info(trace, decoder, unread)
    return clean({
        "mode": "file",
        "run": run,
        "start": {"step": start_step, "sample": start_sample},
        "steps_in_file": list(shown),
        "check": {
            "steps": list(report.steps),
            "passed": report.passed,
            "verdict": report.verdict,
            "failures": check_failures(report),
            "not_checked": check_not_checked(report),
            "identities": [{"identity": r.identity, "title": r.title, "status": r.status} for r in report.identities],
        },
        "steps": steps,
    })  # fmt: skip


def write_page(
    trace_or_path,
    out_path,
    step: int | None = None,
    sample: int | None = None,
    steps: Sequence[int] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    tokenizer=None,
    progress=None,
    unread=None,
    *,
    jobs: int = 1,
    ray_address: str | None = None,
) -> Path:
    """Write the self-contained page of a trace to ``out_path`` and return its path; the summary and
    the check of its steps in ``jobs`` processes or as Ray tasks (:func:`page_data`).

    ``step``/``sample``: what the page shows first (default: the last traced step that reads, its
    first sample); ``steps``, ``max_tokens``: which steps go into the file (module docstring);
    ``tokenizer``: a TokenDecoder, a Hugging Face tokenizer or a path (default: the run record's).
    A step whose files do not read is left out of the page, which says so; ``unread``
    (:class:`~verl_ext.inspect.unread.UnreadSteps`) gets those steps and the missing ones. Bad input
    (an unknown step or sample, a ``step`` that does not read, an unwritable path) is a UsageError;
    the file is written under a temporary name and renamed, so a failure leaves nothing behind."""
    from verl_ext.errors import StepFileError
    from verl_ext.steps.layout import as_trace
    from verl_ext.inspect.table import decoder_for
    from verl_ext.inspect.unread import UnreadSteps, last_step_that_reads, step_reads

    trace = as_trace(trace_or_path)
    if not trace.steps:
        raise UsageError(f"{trace.path} has no traced steps yet")
    out = Path(out_path)
    _require_writable_file(out)
    unread = UnreadSteps.of(trace) if unread is None else unread
    if step is None:
        start = last_step_that_reads(trace, unread)[0]
    else:
        start = trace.require_step(step)
        try:
            step_reads(trace, start)
        except StepFileError as error:
            raise UsageError(f"step {start} does not read: {error}") from None
    group = start_group(trace, start, sample)
    selection = select_steps(trace, start, steps, max_tokens, keep=lambda _: group)
    decoder = decoder_for(trace, tokenizer)
    data = page_data(trace, start, sample, selection, decoder, progress, unread, jobs=jobs, ray_address=ray_address)
    if start in unread.unreadable:  # its footer read, a table of it did not
        raise UsageError(f"step {start} does not read: {unread.unreadable[start]}")
    text = render_page(data, f"verl-ext view · {trace.path}")
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, out)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise UsageError(f"cannot write {out}: {error.strerror or error}") from None
    return out


def start_group(trace, step: int, sample: int | None) -> list[int]:
    """The starting sample and the samples of its group (same uid) at ``step``; UsageError when the
    step has no such sample."""
    if sample is None:
        return []
    import pyarrow.compute as pc

    from verl_ext.trace.reader import listing

    table = trace.read_step(step, ["sample", "uid"])
    rows = table.filter(pc.equal(table.column("sample"), sample))
    if rows.num_rows == 0:
        traced = sorted(pc.unique(table.column("sample")).to_pylist())
        raise UsageError(f"step {step} has no sample {sample} (traced samples: {listing(traced)})")
    uid = rows.column("uid")[0].as_py()
    if uid is None:
        return [sample]
    group = pc.unique(table.filter(pc.equal(table.column("uid"), uid)).column("sample")).to_pylist()
    return [sample, *sorted(s for s in group if s != sample)]


def _require_writable_file(out: Path) -> None:
    if out.is_dir():
        raise UsageError(f"cannot write {out}: it is a directory")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"cannot write {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise UsageError(f"cannot write {out}: permission denied")
