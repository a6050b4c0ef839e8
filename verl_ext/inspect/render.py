"""Tables as text: aligned for a terminal (CJK characters count two columns), CSV, Markdown."""

from __future__ import annotations

import csv
import io
import math
import unicodedata

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
