"""``verl-ext check RUN``: every identity of docs/definitions.md §8 on every traced step."""

from __future__ import annotations

import argparse
import json

from verl_ext.inspect.commands import common

HELP = "check every traced step against the definitions (exit 0 all pass, 1 a violation, 2 bad input)"

#: The item of docs/definitions.md §8 each identity checks, as printed ("8.2": §8, item 2).
SECTION = {
    "advantage_raw": "8.1",
    "whitening": "8.2",
    "whitening_stats": "8.2",
    "returns": "8.3",
    "rewards": "8.4",
    "mask_layout": "8.5",
    "finite": "8.5",
}
LEGEND = (
    "ε = float32 epsilon (1.19e-07); n = terms the producer summed (row length, or the estimator's horizon "
    "if shorter); m = largest |r|, |V|, |R|, |A| of the row; see docs/definitions.md#tolerances"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_run(parser)
    parser.add_argument("--step", type=int, action="append", metavar="S", help="check only step S (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    common.add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    from verl_ext.inspect.check import check_trace
    from verl_ext.inspect.progress import ProgressPrinter

    trace = common.open_run(args.run)
    steps = common.choose_steps(trace, args.step)
    report = check_trace(trace, steps, progress=None if args.quiet else ProgressPrinter("check"))
    print(json.dumps(report.to_dict(), indent=2, ensure_ascii=False) if args.json else format_report(report))
    return 0 if report.passed else 1


def format_report(report) -> str:
    from verl_ext.inspect.render import text_table

    rows = [
        (
            SECTION[r.identity],
            r.title,
            _error_text(r.max_abs_error),
            "—" if r.status == "skipped" else r.tolerance,
            _result_text(r),
        )
        for r in report.identities
    ]
    lines = [
        f"run:       {report.path}",
        f"estimator: {report.algorithm.describe()}",
        f"checked:   {len(report.steps)} step{'s' * (len(report.steps) != 1)}, {report.tokens:,} valid tokens",
        "",
        text_table(
            ["§", "identity", "max abs error", "tolerance", "result"], rows, [False, False, True, False, False]
        ),
    ]
    failed = [r for r in report.identities if r.status == "fail"]
    if failed:
        lines += ["", "first violations:"]
        lines += [f"  §{SECTION[r.identity]} {r.title}: {r.first}" for r in failed]
    sections_by_note: dict[str, list[str]] = {}  # the same note on several identities is said once
    for r in report.identities:
        for note in r.notes:
            sections = sections_by_note.setdefault(note, [])
            if SECTION[r.identity] not in sections:
                sections.append(SECTION[r.identity])
    if sections_by_note:
        lines += ["", "notes:"]
        lines += [f"  §{', §'.join(sections)}: {note}" for note, sections in sections_by_note.items()]
    passed = sum(r.status == "pass" for r in report.identities)
    skipped = sum(r.status == "skipped" for r in report.identities)
    verdict = f"FAIL: {len(failed)} violated" if failed else "PASS"
    lines += ["", LEGEND, f"{verdict} ({passed} passed, {len(failed)} failed, {skipped} skipped)"]
    return "\n".join(lines)


def _error_text(error: float | None) -> str:
    return "—" if error is None else "0" if error == 0 else f"{error:.1e}"


def _result_text(result) -> str:
    if result.status == "fail":
        unit = "token" if result.identity not in ("mask_layout", "whitening_stats") else "entry"
        return f"FAIL ({result.violations} {unit}{'s' * (result.violations != 1)})"
    if result.status == "skipped":
        return "skipped (not applicable)" if any("not applicable" in n for n in result.notes) else "skipped"
    return "pass"
