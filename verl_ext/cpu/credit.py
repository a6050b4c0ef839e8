"""Where the credit lands on the CPU task: the advantage at the verdict token against the rest.

The verdict ("是" or "不", the token after the first "，") is the one decision of a response the
policy has to learn; the outcome reward sits on the last token. Per traced step this reads the
advantage the update used (``advantage``, after whitening) and reports the mean |A| at the
verdict tokens, the mean |A| at the other valid tokens, and the verdict tokens' share of Σ|A|.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verl_ext.cpu.assets import token_id
from verl_ext.cpu.task import VERDICT_MARK


@dataclass(frozen=True)
class VerdictCredit:
    step: int
    score: float  # mean score of the step's responses
    verdict_abs: float  # mean |A| at the verdict tokens
    rest_abs: float  # mean |A| at the other valid tokens
    verdict_share: float  # the verdict tokens' share of the step's Σ|A|
    responses: int  # responses with a verdict token

    def line(self) -> str:
        return (
            f"step {self.step:3d}  score {self.score:.3f}   mean |A|: verdict {self.verdict_abs:.3f}, "
            f"rest {self.rest_abs:.3f}   verdict share of Σ|A| {self.verdict_share:.2f}"
        )


def verdict_positions(trace, step: int) -> dict[int, int]:
    """sample -> token_index of its verdict token, for the step's responses that have one."""
    return _verdict_positions(trace.read_step(step, ["sample", "token_index", "token_id", "mask"]).to_pandas())


def verdict_credit(trace, step: int) -> VerdictCredit:
    """The step's credit at the verdict token (see the module docstring)."""
    table = trace.read_step(step, ["sample", "token_index", "token_id", "mask", "score", "advantage"]).to_pandas()
    verdicts = _verdict_positions(table)
    table = table[table["mask"]]
    at_verdict = np.array([verdicts.get(s) == t for s, t in zip(table["sample"], table["token_index"])], dtype=bool)
    magnitude = table["advantage"].abs().to_numpy(np.float64)
    total = magnitude.sum()
    return VerdictCredit(
        step=step,
        score=float(table.groupby("sample")["score"].sum().mean()),
        verdict_abs=float(magnitude[at_verdict].mean()) if at_verdict.any() else float("nan"),
        rest_abs=float(magnitude[~at_verdict].mean()) if (~at_verdict).any() else float("nan"),
        verdict_share=float(magnitude[at_verdict].sum() / total) if total > 0 else float("nan"),
        responses=len(verdicts),
    )


def _verdict_positions(table) -> dict[int, int]:
    marks = table[(table["token_id"] == token_id(VERDICT_MARK)) & table["mask"]]
    first = marks.groupby("sample")["token_index"].min() + 1
    valid = table[table["mask"]].groupby("sample")["token_index"].max()
    return {int(sample): int(index) for sample, index in first.items() if index <= valid[sample]}
