"""``verl-ext doctor``: its arguments and its run."""

from __future__ import annotations

import argparse
import sys

from verl_ext.cli.common import emit
from verl_ext.integration.diagnosis import diagnose, verl_noise


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-subprocess", action="store_true", help="skip the fresh `import verl` check")


def run(args: argparse.Namespace) -> int:
    with verl_noise() as noise:  # verl's import-time warnings (no accelerator, optional engines): not findings
        findings = list(diagnose(fresh_import=not args.no_subprocess))
    width = max(len(f.topic) for f in findings)
    broken = [f for f in findings if not f.ok]
    lines = [f"{'ok ' if finding.ok else 'BAD'}  {finding.topic:<{width}}  {finding.detail}" for finding in findings]
    emit("\n".join(lines) + f"\n\n{len(findings) - len(broken)} ok, {len(broken)} broken")
    if noise:
        sources = ", ".join(dict.fromkeys(noise))
        print(f"note: not shown: {len(noise)} warning(s) that verl and its dependencies give when loaded on this machine (from {sources})", file=sys.stderr)
    return 1 if broken else 0
