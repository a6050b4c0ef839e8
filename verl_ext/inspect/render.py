"""What the inspection prints: tables as text (aligned for a terminal, CJK characters counting two
columns), CSV and Markdown; the check report; progress lines on stderr."""

from __future__ import annotations

import csv
import io
import math
import sys
import time
import unicodedata
from typing import TextIO

import numpy as np
import pyarrow as pa

FORMATS = ("text", "csv", "markdown")


def display_width(text: str) -> int:
    """Terminal columns ``text`` takes: wide and full-width characters two, combining marks none."""
    width = 0
    for ch in text:
        if unicodedata.combining(ch):
            continue
        width += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return width


def render(table: pa.Table, fmt: str = "text", digits: int = 4) -> str:
    """``table`` in ``fmt``. Text and Markdown drop columns that are null everywhere and round
    floats to ``digits`` decimals; CSV keeps every column and each float's shortest exact repr."""
    if fmt == "csv":
        return _csv(table)
    table = table.select([name for name in table.column_names if table.column(name).null_count < max(len(table), 1)])
    numeric = [pa.types.is_integer(t) or pa.types.is_floating(t) for t in table.schema.types]
    cells = [[_cell(value, digits) for value in table.column(name).to_pylist()] for name in table.column_names]
    rows = list(zip(*cells)) if cells else []
    if fmt == "markdown":
        return markdown_table(table.column_names, rows, numeric)
    if fmt == "text":
        return text_table(table.column_names, rows, numeric)
    raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")


def _cell(value, digits: int) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        text = f"{value:.{digits}f}"
        return text[1:] if text.startswith("-") and float(text) == 0 else text  # no "-0.0000"
    return str(value)


def text_table(header: list[str], rows: list[tuple[str, ...]], right: list[bool]) -> str:
    """Columns padded to their display width, ``right[i]`` = right-aligned (numbers)."""
    widths = [max([display_width(h)] + [display_width(row[i]) for row in rows]) for i, h in enumerate(header)]

    def line(cells) -> str:
        padded = []
        for cell, width, align_right in zip(cells, widths, right):
            pad = " " * (width - display_width(cell))
            padded.append(pad + cell if align_right else cell + pad)
        return "  ".join(padded).rstrip()

    return "\n".join([line(header), *(line(row) for row in rows)])


def markdown_table(header: list[str], rows: list[tuple[str, ...]], right: list[bool]) -> str:
    def line(cells) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    rule = "|" + "|".join("---:" if align_right else ":---" for align_right in right) + "|"
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def _csv(table: pa.Table) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(table.column_names)
    columns = [_csv_column(table.column(name)) for name in table.column_names]
    writer.writerows(zip(*columns))
    return out.getvalue().rstrip("\n")


def _csv_column(column: pa.ChunkedArray) -> list[str]:
    values = column.to_pylist()
    if pa.types.is_float32(column.type):  # the shortest text that reads back as the same float32
        return ["" if v is None else str(np.float32(v)) for v in values]
    return ["" if v is None else ("true" if v else "false") if isinstance(v, bool) else str(v) for v in values]


# --------------------------------------------------------------------------- the check report

LEGEND = (
    "ε = float32 epsilon (1.19e-07); n = terms the producer summed (row length, or the estimator's horizon "
    "if shorter); m = largest |r|, |V|, |R|, |A| of the row; see docs/definitions.md#tolerances"
)


def format_report(report, accept_unchecked: bool = False) -> str:
    """The report as text, its verdict on the last line; ``accept_unchecked``: the caller accepts
    identities that were not checked (``check --allow-unchecked``), which the verdict still names."""
    definition = {r.identity: report.definition(r.identity) for r in report.identities}
    section = {name: record.section for name, record in definition.items()}
    rows = [
        (
            section[r.identity],
            r.title,
            _error_text(r.max_abs_error),
            "—" if r.status in ("skipped", "unchecked") else r.tolerance,
            _result_text(r, definition[r.identity].counts),
        )
        for r in report.identities
    ]
    checked = len(report.steps) - len(report.unreadable)
    unreadable = f" ({len(report.unreadable)} more could not be read)" if report.unreadable else ""
    lines = [
        f"run:       {report.path}",
        f"estimator: {report.algorithm.describe()}",
        *(
            [f"rollout:   {report.run.describe_rollout()}", f"finished:  {report.run.describe_end()}"]
            if report.run is not None else []
        ),
        f"checked:   {checked} step{'s' * (checked != 1)}, {report.tokens:,} valid tokens{unreadable}",
        "",
        text_table(
            ["§", "identity", "max abs error", "tolerance", "result"], rows, [False, False, True, False, False]
        ),
    ]
    failed = [r for r in report.identities if r.status == "fail"]
    if failed:
        lines += ["", "first violations:"]
        lines += [f"  §{section[r.identity]} {r.title}: {r.first}" for r in failed]
    sections_by_note: dict[str, list[str]] = {}  # the same note on several identities is said once
    for r in report.identities:
        for note in r.notes:
            sections = sections_by_note.setdefault(note, [])
            if section[r.identity] not in sections:
                sections.append(section[r.identity])
    if sections_by_note:
        lines += ["", "notes:"]
        lines += [f"  §{', §'.join(sections)}: {note}" for note, sections in sections_by_note.items()]
    lines += ["", LEGEND, verdict_line(report, accept_unchecked)]
    return "\n".join(lines)


def verdict_line(report, accept_unchecked: bool = False) -> str:
    """``PASS (…)``, ``FAIL: n violated (…)``, or ``INCOMPLETE (…): why`` when an identity that applies
    to the run was not evaluated (never PASS then: the counts say how many, the reasons what to do).
    For a run that did not finish the counts end with how far it got: ``PASS (…; 8 of 40 planned steps;
    the run did not finish)``, still a pass of the steps it wrote."""
    count = {status: sum(r.status == status for r in report.identities) for status in ("pass", "fail", "unchecked", "skipped")}
    not_checked = f", {count['unchecked']} not checked" if count["unchecked"] else ""
    unfinished = report.run.unfinished() if report.run is not None else None
    counts = f"({count['pass']} passed, {count['fail']} failed{not_checked}, {count['skipped']} skipped{'; ' + unfinished if unfinished else ''})"
    if count["fail"]:
        return f"FAIL: {count['fail']} violated {counts}"
    if count["unchecked"]:
        accepted = ", accepted by --allow-unchecked" if accept_unchecked else ""
        return f"INCOMPLETE{accepted} {counts}: {'; '.join(report.not_checked)}"
    return f"PASS {counts}"


def _error_text(error: float | None) -> str:
    return "—" if error is None else "0" if error == 0 else f"{error:.1e}"


def _result_text(result, counts: str) -> str:
    if result.status == "fail":
        return f"FAIL ({result.violations} {counts}{'s' * (result.violations != 1)})"
    if result.status == "unchecked":
        return "NOT CHECKED"
    if result.status == "skipped":
        return "skipped (not applicable)" if any("not applicable" in n for n in result.notes) else "skipped"
    return "pass"


# --------------------------------------------------------------------------- progress


def per_second(rate: float) -> str:
    """A rate with its unit: ``2.3M``, ``45.6k``, ``789`` (one decimal from a thousand up)."""
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if round(rate / scale, 1) >= 1:
            return f"{rate / scale:.1f}{unit}"
    return f"{rate:.0f}"


class ProgressPrinter:
    """Callable as ``progress(done, total, tokens)``; prints at most one line per ``interval``
    seconds, nothing at all for a scan that ends within ``interval``."""

    def __init__(self, what: str, stream: TextIO | None = None, interval: float = 1.0):
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.started = time.perf_counter()
        self.last_printed = self.started
        self.printed = False

    def __call__(self, done: int, total: int, tokens: int) -> None:
        now = time.perf_counter()
        if now - self.last_printed < self.interval and not (done == total and self.printed):
            return
        elapsed = now - self.started
        rate = f", {per_second(tokens / elapsed)} tokens/s" if elapsed > 0 else ""
        print(
            f"{self.what}: step {done}/{total}, {tokens:,} tokens, {elapsed:.1f} s{rate}", file=self.stream, flush=True
        )
        self.last_printed = now
        self.printed = True
