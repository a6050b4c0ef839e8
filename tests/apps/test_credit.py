"""Where the credit lands (verl_ext.apps.credit), by hand on the learning run's trace (tests/apps/
conftest.py): the verdict token after the first "，", its share of Σ|A| under the recorded and the
re-estimated advantages, the critic's explained variance after and up to the verdict; and the
demo's credit lines."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import tests.support.reference as ref
from tests.apps.conftest import LEARNING_STEPS as STEPS
from tests.apps.conftest import dense, valid_tokens
from tests.cpu.helpers import BOTH_CORES_GROUP

pytestmark = pytest.mark.xdist_group(BOTH_CORES_GROUP)  # the learning run's worker (tests/apps/conftest.py)

EOS_ID = 3  # "</s>" in the CPU tokenizer (verl_ext.tasks.arith.assets: <pad>, <unk>, <s>, </s>, ...)


def hand_verdicts(frame: pd.DataFrame) -> dict[int, int]:
    """sample -> token_index of the token after the first "，", unless that token is EOS or absent."""
    from verl_ext.tasks.arith.assets import token_id

    verdicts = {}
    for sample, rows in valid_tokens(frame).groupby("sample"):
        ids = rows.sort_values("token_index")["token_id"].tolist()
        if token_id("，") in ids:
            after = ids.index(token_id("，")) + 1
            if after < len(ids) and ids[after] != EOS_ID:
                verdicts[int(sample)] = after
    return verdicts


def test_the_credit_at_the_verdict_by_hand(learning_trace):
    """The demo's credit line: the verdict token follows the first "，", and its |A| against the rest."""
    from verl_ext.apps.credit import step_credit
    from verl_ext.tasks.arith.assets import token_id

    frame = learning_trace.read_step(STEPS).to_pandas()
    positions = hand_verdicts(frame)
    valid = frame[frame["mask"]]
    verdict_tokens = [valid[(valid["sample"] == s) & (valid["token_index"] == t)]["token_id"].item() for s, t in positions.items()]
    assert np.isin(verdict_tokens, [token_id("是"), token_id("不")]).mean() > 0.95  # well-formed answers: 是的 or 不是
    at_verdict = np.array([positions.get(s) == t for s, t in zip(valid["sample"], valid["token_index"])])
    magnitude = valid["advantage"].abs().to_numpy(np.float64)
    credit = step_credit(learning_trace, STEPS)
    assert credit.verdicts == positions and len(positions) > 100
    assert credit.verdict_abs == pytest.approx(magnitude[at_verdict].mean())
    assert credit.rest_abs == pytest.approx(magnitude[~at_verdict].mean())
    assert credit.verdict_share == pytest.approx(magnitude[at_verdict].sum() / magnitude.sum())
    assert credit.score == pytest.approx(valid.groupby("sample")["score"].sum().mean())
    assert credit.shares_by_estimator == {}  # only when asked


def raw_advantages(frame: pd.DataFrame) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """mc, gae0.95 and td0 raw advantages (dense, γ = 1) from the recorded rewards and values."""
    mask = np.zeros_like(dense(frame, "reward"), dtype=bool)
    mask[frame["sample"], frame["token_index"]] = frame["mask"]
    rewards, values = dense(frame, "reward"), dense(frame, "value")
    return {
        "mc": ref.mc_returns(rewards, mask, 1.0) - values,
        "gae0.95": ref.gae_advantages(rewards, values, mask, 1.0, 0.95),
        "td0": ref.td0_returns(rewards, values, mask, 1.0) - values,
    }, mask


@pytest.mark.parametrize("step", [1, STEPS])
def test_the_verdict_share_by_estimator_by_hand(learning_trace, step):
    from verl_ext.apps.credit import side_by_side, step_credit

    assert learning_trace.record.algorithm.get("gamma", 1.0) == 1.0
    frame = learning_trace.read_step(step).to_pandas()
    advantages, mask = raw_advantages(frame)
    at_verdict = np.zeros_like(mask)
    for sample, index in hand_verdicts(frame).items():
        at_verdict[sample, index] = True
    assert side_by_side() == ("mc", "gae0.95", "td0")
    shares = step_credit(learning_trace, step, side_by_side()).shares_by_estimator
    assert list(shares) == ["mc", "gae0.95", "td0"]
    for label, advantage in advantages.items():
        magnitude = np.abs(np.where(mask, advantage, 0.0))
        assert shares[label] == pytest.approx(magnitude[at_verdict].sum() / magnitude.sum(), rel=1e-9), label
    # one label at a time gives the same number
    assert step_credit(learning_trace, step, ("td0",)).shares_by_estimator == {"td0": shares["td0"]}


def hand_critic_at_verdict(frame: pd.DataFrame) -> tuple[float, float]:
    rewards, values = dense(frame, "reward"), dense(frame, "value")
    mask = np.zeros_like(rewards, dtype=bool)
    mask[frame["sample"], frame["token_index"]] = frame["mask"]
    returns = ref.mc_returns(rewards, mask, 1.0)
    after, before = np.zeros_like(mask), np.zeros_like(mask)
    for sample, index in hand_verdicts(frame).items():
        positions = np.arange(mask.shape[1])
        after[sample] = mask[sample] & (positions > index)
        before[sample] = mask[sample] & (positions <= index)

    def explained(selected):
        g, v = returns[selected], values[selected]
        return 1 - np.var(g - v, ddof=1) / np.var(g, ddof=1)

    return explained(after), explained(before)


@pytest.mark.parametrize("step", [1, STEPS])
def test_the_critic_at_the_verdict_by_hand(learning_trace, step):
    from verl_ext.apps.credit import step_credit

    credit = step_credit(learning_trace, step)
    expected_after, expected_before = hand_critic_at_verdict(learning_trace.read_step(step).to_pandas())
    assert credit.ev_after_verdict == pytest.approx(expected_after, rel=1e-9, abs=1e-12)
    assert credit.ev_before_verdict == pytest.approx(expected_before, rel=1e-9, abs=1e-12)


def test_the_pretrained_critic_sees_the_outcome_after_the_verdict_at_step_1(learning_trace):
    from verl_ext.apps.credit import step_credit

    credit = step_credit(learning_trace, 1)
    assert credit.ev_after_verdict >= 0.5 and credit.ev_before_verdict < credit.ev_after_verdict, credit


def test_the_verdict_positions_by_hand_on_a_made_up_step():
    """No trace needed: the token after the first valid "，", unless it is EOS or not valid."""
    from verl_ext.apps.credit import _verdicts
    from verl_ext.steps.layout import StepLayout
    from verl_ext.tasks.arith.assets import token_id

    ids = lambda text: [token_id(ch) for ch in text]  # noqa: E731
    pad = 0
    responses = {  # sample -> (token ids, valid length)
        0: (ids("等于5，是的！") + [EOS_ID], 8),  # verdict at 4
        1: (ids("等于5，") + [EOS_ID, pad, pad], 5),  # "，</s>": no verdict
        2: (ids("等于12，不是，是") + [EOS_ID], 10),  # the first "，" counts: verdict at 5
        3: (ids("等于5，是"), 4),  # truncated after "，": the verdict position is not valid
        4: (ids("等于5") + [EOS_ID] + ids("，是"), 4),  # a "，" after the valid tokens does not count
        5: (ids("是的！") + [EOS_ID], 4),  # no "，"
    }
    rows = pd.DataFrame([
        {"sample": sample, "token_index": index, "token_id": token, "mask": index < length}
        for sample, (tokens, length) in responses.items()
        for index, token in enumerate(tokens)
    ])  # fmt: skip
    layout = StepLayout(rows["sample"].to_numpy(), rows["token_index"].to_numpy(), rows["mask"].to_numpy())
    valid = layout.valid_rows
    verdict_of_token, verdicts = _verdicts(rows["token_id"].to_numpy()[valid], layout.token_index[valid], layout, token_id("，"), EOS_ID)
    assert verdicts == {0: 4, 2: 5}
    expected = [{0: 4, 2: 5}.get(sample, -1) for sample in rows["sample"].to_numpy()[valid]]
    assert verdict_of_token.tolist() == expected


def test_the_demo_prints_credit_every_tenth_step_and_the_estimators_side_by_side(learning_trace, capsys):
    """One credit line per 10 steps (and the first and last), not one per step; then the verdict's
    share under mc, GAE(0.95) and td0 and one response under each."""
    from verl_ext.apps import demo

    credits = demo._print_credit(learning_trace, "arith")
    assert max(credits) == STEPS and all(credits[step].shares_by_estimator for step in range(STEPS - 9, STEPS + 1))
    lines = capsys.readouterr().out.splitlines()
    assert [int(line.split()[1]) for line in lines] == sorted({1, *range(10, STEPS + 1, 10), STEPS}) and len(lines) > 2
    assert all("critic EV after the verdict" in line for line in lines)

    demo._print_side_by_side(learning_trace, credits, 5)
    out = capsys.readouterr().out
    assert f"step {STEPS}" in out and f"mean of steps {STEPS - 9}-{STEPS}" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("token_index"))
    assert header.split() == ["token_index", "token", "value", "mc", "gae0.95", "td0"]


def test_the_demo_credit_lines_work_without_a_critic(tmp_path, capsys):
    """`verl-ext demo --estimator grpo`: a run without values has no critic column and nothing to
    re-estimate from, and says so instead of failing after training."""
    from tests.inspect.test_critic_diagnostics import critic_free_trace
    from verl_ext.apps import demo
    from verl_ext.trace.reader import open_trace

    trace = open_trace(critic_free_trace(tmp_path))
    credits = demo._print_credit(trace, "arith")
    assert list(credits) == [1] and credits[1].ev_after_verdict is None and credits[1].shares_by_estimator == {}
    line = capsys.readouterr().out
    assert line.startswith("  step   1") and "critic EV" not in line


def test_the_demo_shows_a_wrong_answer_whose_verdict_is_pushed_down_and_says_why(tmp_path):
    """The demo's rule for the response it shows token by token (and in the heatmap): the first not
    fully right whose verdict token gets a negative advantage; else the first not fully right with
    a verdict; else sample 0. Scores and advantages set by hand."""
    from dataclasses import replace

    import torch

    from tests.inspect.inspect_helpers import algorithm, by_definition, random_batch, write_trace
    from verl_ext.apps import demo
    from verl_ext.trace.reader import open_trace

    def trace_with(advantages, scores, name):
        batch = by_definition(random_batch(1, B=4, T=3, interior=False), "mc", 1.0)
        batch.mask[:] = 1
        final = torch.zeros(4, 3)
        final[:, 2] = torch.tensor(scores)
        batch = replace(batch, scores=final, rewards=final.clone(), advantages=torch.tensor(advantages))
        return open_trace(write_trace(tmp_path / name, algorithm("mc"), {1: batch}))

    verdicts = {0: 1, 1: 1, 2: 2}  # sample 3 has no verdict
    advantages = [[0.1, 0.2, 0.3], [0.1, 0.4, 0.2], [0.5, 0.5, -0.75], [-1.0, -1.0, -1.0]]
    # sample 0 right; 1 wrong, its verdict pushed up (+0.4); 2 wrong, pushed down (−0.75); 3 wrong, no verdict
    sample, why = demo._interesting_sample(trace_with(advantages, [1.0, 0.2, 0.0, 0.0], "a"), 1, verdicts)
    assert sample == 2
    assert why == "the first not fully right (score 0.0) whose verdict, token 2, gets a negative advantage (-0.75): the update pushes that verdict down"
    advantages[2][2] = 0.75  # no wrong verdict is pushed down: the first wrong one with a verdict
    sample, why = demo._interesting_sample(trace_with(advantages, [1.0, 0.2, 0.0, 0.0], "b"), 1, verdicts)
    assert (sample, why) == (1, "the first with a verdict that is not fully right (score 0.2)")
    sample, why = demo._interesting_sample(trace_with(advantages, [1.0, 1.0, 1.0, 0.0], "c"), 1, verdicts)
    assert (sample, why) == (0, "the first response (every verdict was right)")
