"""Every ``verl-ext`` inspection line of the command blocks of the README and of every Markdown page
under docs/ runs as written on the traces of the two demos (issue 34): a newcomer types them first.

No run of its own: each test reads a run the suite already makes, on that run's xdist worker.
``make demo``'s trace is the learning run of tests/apps/conftest.py (the demo's own recipe, ``mc``,
seed 0, with fewer steps); ``verl-ext demo --task tool``'s is the tool demo's run there. In a line,
``outputs/demo/trace`` names the first, ``outputs/demo_tool/trace`` the second, and ``PATH`` either
(the line runs on both). A line that would serve (``view`` without ``--out``) writes its page
instead: the page is what the server sends. Each line runs in a scratch working directory, so that
what it writes (``--out plots/``) lands there. A line whose comment says "a run with a critic" runs
on both demos' traces (``mc``, and ``turn_gae`` with the tool task's pretrained critic); on a run
without a critic it must say why in one line and exit 2, as the README says (:func:`run_readme_lines`
holds a critic-free trace to that when given one)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.apps.conftest import TOOL_DEMO_GROUP
from tests.cpu.helpers import BOTH_CORES_GROUP

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The pages whose lines run as the README's do: every Markdown file under docs/.
DOCS = ROOT / "docs"
#: The subcommands that read a trace and change nothing (the others train or set up).
INSPECTION = {"check", "show", "summary", "table", "compare", "plot", "export", "view", "sql"}
DEMO_TRACE, TOOL_DEMO_TRACE, ANY_TRACE = "outputs/demo/trace", "outputs/demo_tool/trace", "PATH"
#: What the comment of a line that has nothing to show on a critic-free run says.
NEEDS_A_CRITIC = "a run with a critic"


def inspection_lines(document: Path) -> list[str]:
    """A document's inspection lines: each fenced block's lines that start ``verl-ext <inspection>``."""
    lines, fenced = [], False
    for line in document.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and (command := re.match(r"verl-ext (\w+)", line)) and command.group(1) in INSPECTION:
            lines.append(line)
    return lines


def readme_lines() -> list[str]:
    """The README's inspection lines."""
    return inspection_lines(README)


def documented_lines() -> list[str]:
    """The inspection lines of the README and of every page under docs/, by the same rules."""
    return [line for document in [README, *sorted(DOCS.rglob("*.md"))] for line in inspection_lines(document)]


def lines_for(trace_name: str) -> list[str]:
    return [line for line in documented_lines() if {trace_name, ANY_TRACE} & set(shlex.split(line, comments=True))]


def run_readme_lines(lines: list[str], trace: str, scratch: Path, run_cli, *, has_critic: bool) -> None:
    failures, ran = [], set()
    for line in lines:
        words = [trace if word in (DEMO_TRACE, TOOL_DEMO_TRACE, ANY_TRACE) else word for word in shlex.split(line, comments=True)[1:]]
        if words[0] == "view" and "--out" not in words:
            words += ["--out", str(scratch / "served.html"), "--quiet"]
        if tuple(words) in ran:  # the first hour's lines, the sections' and the docs pages' can be one command
            continue
        ran.add(tuple(words))
        code, out, err = run_cli(*words)
        if NEEDS_A_CRITIC in line.partition("#")[2] and not has_critic:
            said = err.strip().splitlines()[-1] if err.strip() else ""
            if code != 2 or "Traceback" in err or not said.startswith(f"verl-ext {words[0]}: "):
                failures.append(f"{line}\n  on a run without a critic: exit {code} (2 expected), stderr: {err.strip()[-500:]}")
        elif code != 0 or not (out or words[0] in ("plot", "view")):
            failures.append(f"{line}\n  exit {code}; stderr: {err.strip()[-500:]}")
    assert not failures, "README and docs/ lines that do not run as written:\n" + "\n".join(failures)


def test_the_readme_shows_the_first_hour_and_every_inspection_command():
    """What the two tests below run is there: the first hour's lines on make demo's trace, the tool
    demo's line, and each inspection command of "Inspecting a trace"."""
    assert {line.split()[1] for line in readme_lines() if DEMO_TRACE in line} >= {"check", "show", "summary", "view"}
    assert any(TOOL_DEMO_TRACE in line for line in readme_lines())
    assert {line.split()[1] for line in readme_lines() if ANY_TRACE in line} >= {"check", "show", "summary", "plot", "compare", "view"}


@pytest.mark.xdist_group(BOTH_CORES_GROUP)  # the learning run's worker (tests/apps/conftest.py)
def test_every_readme_line_runs_on_make_demos_trace(learning_runs, tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    run_readme_lines(lines_for(DEMO_TRACE), str(learning_runs[0] / "trace"), tmp_path, run_cli, has_critic=True)
    assert list((tmp_path / "plots").glob("*.png")) and (tmp_path / "run.html").is_file() and (tmp_path / "served.html").is_file()


@pytest.mark.xdist_group(TOOL_DEMO_GROUP)  # the tool demo's worker (tests/apps/conftest.py)
def test_every_readme_line_runs_on_the_tool_demos_trace(tool_demo, tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    run_readme_lines(lines_for(TOOL_DEMO_TRACE), str(tool_demo[0] / "trace"), tmp_path, run_cli, has_critic=True)
    assert list((tmp_path / "plots").glob("*.png")) and (tmp_path / "run.html").is_file()
