"""The policy learns: verl's real trainer (in process) on the CPU task, ``mc``, a fixed seed, run twice
at once. Held-out accuracy is verl's own validation. The same run's trace then serves the checks of
``compare`` (against tests/reference.py, on groups of four responses) and of the verdict-credit lines
of the demo."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

import tests.reference as ref
from tests.cpu.helpers import BOTH_CORES_GROUP
from verl_ext.apps.learning import read_metrics

pytestmark = pytest.mark.xdist_group(BOTH_CORES_GROUP)  # two trainers at once: last (tests/conftest.py)

STEPS = 25


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, cpu_env):
    outputs = [tmp_path_factory.mktemp(f"learn{i}") for i in range(2)]
    command = [sys.executable, "-m", "verl_ext.apps.learning", "--estimator", "mc", "--seed", "0",
               "--steps", str(STEPS), "--test-freq", str(STEPS), "--trace"]  # fmt: skip
    processes = [
        subprocess.Popen([*command[:3], str(out), *command[3:]], env=cpu_env(out), cwd=out,
                         stdout=open(out / "output.log", "w"), stderr=subprocess.STDOUT)  # fmt: skip
        for out in outputs
    ]
    for process, out in zip(processes, outputs):
        if process.wait(timeout=600) != 0:
            pytest.fail(f"learning run failed:\n{(out / 'output.log').read_text()[-4000:]}")
    return outputs


def held_out_accuracy(out) -> dict[int, float]:
    return {
        step: value
        for step, data in read_metrics(out).items()
        for key, value in data.items()
        if key.startswith("val-core/verl_ext/sum_check/acc/mean@8")
    }


def test_held_out_accuracy_rises_by_a_clear_margin(two_runs):
    accuracy = held_out_accuracy(two_runs[0])
    assert sorted(accuracy) == [0, STEPS]
    assert accuracy[STEPS] - accuracy[0] >= 0.10, accuracy


#: Not reproducible by design: wall-clock timings; and the rollout server's own log-probs, which
#: can differ in the last bits with the shape of the batch the requests happened to share (the
#: sampled tokens do not: each request samples from its own seeded stream).
NOT_REPRODUCIBLE = ("timing", "perf/", "actor/perf", "critic/perf", "training/rollout_probs_diff", "rollout_corr/")


def test_the_same_seed_gives_the_same_numbers(two_runs):
    def reproducible(out):
        return {
            step: {k: v for k, v in data.items() if not k.startswith(NOT_REPRODUCIBLE)}
            for step, data in read_metrics(out).items()
        }

    first, second = (reproducible(out) for out in two_runs)
    assert first == second and len(first) == STEPS + 1
    from verl_ext.trace.reader import open_trace

    for step in (1, STEPS):  # uids are verl's random uuid4s
        tables = [open_trace(str(out / "trace")).read_step(step).drop_columns(["uid", "rollout_log_prob"]) for out in two_runs]
        assert tables[0].equals(tables[1])


@pytest.fixture(scope="module")
def last_step(two_runs):
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(two_runs[0] / "trace"))
    return trace, trace.read_step(STEPS).to_pandas()


def dense(frame: pd.DataFrame, column: str) -> np.ndarray:
    width = int(frame["token_index"].max()) + 1
    out = np.zeros((int(frame["sample"].max()) + 1, width))
    out[frame["sample"], frame["token_index"]] = frame[column].to_numpy(np.float64)
    return out


def test_compare_matches_the_direct_sums_on_a_real_step(last_step):
    from verl_ext.inspect import compare

    trace, frame = last_step
    result = compare(trace, STEPS, sample=5, n=2, lambdas=(0.0, 0.5, 1.0))
    mask = np.zeros_like(dense(frame, "reward"), dtype=bool)
    mask[frame["sample"], frame["token_index"]] = frame["mask"]
    rewards, values = dense(frame, "reward"), dense(frame, "value")
    expected = {
        "mc": ref.mc_returns(rewards, mask, 1.0) - values,
        "td0": ref.td0_returns(rewards, values, mask, 1.0) - values,
        "nstep2": ref.nstep_returns(rewards, values, mask, 1.0, 2) - values,
        **{f"gae{lam:g}": ref.gae_advantages(rewards, values, mask, 1.0, lam) for lam in (0.0, 0.5, 1.0)},
    }
    assert result.labels == tuple(expected)  # the run's own estimator, mc, is already a column
    table = result.table.to_pandas()
    for label, reference in expected.items():
        np.testing.assert_allclose(table[label], reference[5][mask[5]], rtol=1e-9, atol=1e-9)
    # the recorded raw advantage of the run (mc) is the mc column
    np.testing.assert_allclose(table["mc"], frame[frame["sample"] == 5].query("mask")["advantage_raw"], atol=1e-6)

    statistics = result.statistics.to_pandas().set_index("estimator")
    tokens = frame[frame["mask"]]
    for label, reference in expected.items():
        values_at = reference[tokens["sample"], tokens["token_index"]]
        assert statistics.at[label, "var_batch"] == pytest.approx(np.var(values_at, ddof=1), rel=1e-9)
        by_prompt = pd.Series(values_at).groupby(tokens["uid"].to_numpy()).var(ddof=1)
        assert tokens.groupby("uid")["sample"].nunique().min() == 4  # groups of four responses
        assert statistics.at[label, "var_within_group"] == pytest.approx(by_prompt.mean(), rel=1e-9)


def test_verdict_credit_by_hand(last_step):
    """The demo's credit line: the verdict token follows the first "，", and its |A| against the rest."""
    from verl_ext.tasks.arith.assets import token_id
    from verl_ext.tasks.arith.credit import verdict_credit, verdict_positions

    trace, frame = last_step
    positions = verdict_positions(trace, STEPS)
    valid = frame[frame["mask"]]
    verdicts = []
    for sample, index in positions.items():
        tokens = valid[valid["sample"] == sample].set_index("token_index")["token_id"]
        assert tokens[index - 1] == token_id("，") and list(tokens[: index - 1]).count(token_id("，")) == 0
        verdicts.append(tokens[index])
    assert np.isin(verdicts, [token_id("是"), token_id("不")]).mean() > 0.95  # well-formed answers: 是的 or 不是
    at_verdict = np.array([positions.get(s) == t for s, t in zip(valid["sample"], valid["token_index"])])
    magnitude = valid["advantage"].abs().to_numpy(np.float64)
    credit = verdict_credit(trace, STEPS)
    assert credit.verdict_abs == pytest.approx(magnitude[at_verdict].mean())
    assert credit.rest_abs == pytest.approx(magnitude[~at_verdict].mean())
    assert credit.verdict_share == pytest.approx(magnitude[at_verdict].sum() / magnitude.sum())
    assert credit.responses == len(positions) > 100


# --------------------------------------------------------------------------- the pretrained critic in RL

EOS_ID = 3  # "</s>" in the CPU tokenizer (verl_ext.tasks.arith.assets: <pad>, <unk>, <s>, </s>, ...)


@pytest.fixture(scope="module")
def trace(two_runs):
    from verl_ext.trace.reader import open_trace

    return open_trace(str(two_runs[0] / "trace"))


def valid_tokens(frame: pd.DataFrame) -> pd.DataFrame:
    """The valid tokens; each response's mask is a prefix, so token_index is also the rank."""
    valid = frame[frame["mask"]]
    assert (valid.groupby("sample")["token_index"].max() + 1 == valid.groupby("sample").size()).all()
    return valid


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


def test_verl_critic_starts_from_the_pretrained_critic(trace, assets):
    """At step 1 verl's critic has not been updated: its recorded values are the pretrained critic's
    own predictions, V(s_t) being the head's output at the position before response token t."""
    import torch
    from transformers import AutoModelForTokenClassification

    frame = trace.read_step(1).to_pandas()
    prompts = trace.prompts(1).to_pandas().set_index("sample")["prompt_token_ids"]
    critic = AutoModelForTokenClassification.from_pretrained(assets.critic_dir, dtype=torch.float32).eval()
    valid = valid_tokens(frame)
    for sample in range(0, int(frame["sample"].max()) + 1, 16):  # 8 of the 128 responses
        tokens = valid[valid["sample"] == sample].sort_values("token_index")
        prompt, response = list(prompts[sample]), tokens["token_id"].tolist()
        input_ids = torch.tensor([prompt + response])
        with torch.no_grad():
            head = critic(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                position_ids=torch.arange(input_ids.shape[1])[None],
            ).logits[0, :, 0]  # fmt: skip
        expected = head[len(prompt) - 1 : len(prompt) + len(response) - 1].numpy()  # state s_t: prompt + response[:t]
        np.testing.assert_allclose(tokens["value"].to_numpy(), expected, atol=1e-4, rtol=0)


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
def test_verdict_share_by_estimator_by_hand(trace, step):
    from verl_ext.tasks.arith.credit import verdict_share_by_estimator

    assert trace.record.algorithm.get("gamma", 1.0) == 1.0
    frame = trace.read_step(step).to_pandas()
    advantages, mask = raw_advantages(frame)
    verdicts = hand_verdicts(frame)
    at_verdict = np.zeros_like(mask)
    for sample, index in verdicts.items():
        at_verdict[sample, index] = True
    assert len(verdicts) > 100
    shares = verdict_share_by_estimator(trace, step)
    assert list(shares) == ["mc", "gae0.95", "td0"]
    for label, advantage in advantages.items():
        magnitude = np.abs(np.where(mask, advantage, 0.0))
        assert shares[label] == pytest.approx(magnitude[at_verdict].sum() / magnitude.sum(), rel=1e-9), label
    # one label at a time gives the same number
    assert verdict_share_by_estimator(trace, step, labels=("td0",)) == {"td0": shares["td0"]}


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
def test_critic_at_verdict_by_hand(trace, step):
    from verl_ext.tasks.arith.credit import critic_at_verdict

    after, before = critic_at_verdict(trace, step)
    expected_after, expected_before = hand_critic_at_verdict(trace.read_step(step).to_pandas())
    assert after == pytest.approx(expected_after, rel=1e-9, abs=1e-12)
    assert before == pytest.approx(expected_before, rel=1e-9, abs=1e-12)


def test_the_pretrained_critic_sees_the_outcome_after_the_verdict_at_step_1(trace):
    from verl_ext.tasks.arith.credit import critic_at_verdict

    after, before = critic_at_verdict(trace, 1)
    assert after >= 0.5 and before < after, (after, before)


def test_verdict_positions_by_hand_on_a_made_up_step():
    """No trace needed: the token after the first valid "，", unless it is EOS or not valid."""
    from verl_ext.tasks.arith.assets import token_id
    from verl_ext.tasks.arith.credit import _verdict_positions

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
    rows = [
        {"sample": sample, "token_index": index, "token_id": token, "mask": index < length}
        for sample, (tokens, length) in responses.items()
        for index, token in enumerate(tokens)
    ]
    assert _verdict_positions(pd.DataFrame(rows)) == {0: 4, 2: 5}


def test_the_demo_prints_credit_every_tenth_step_and_the_estimators_side_by_side(trace, capsys):
    """Issue 15, item 6: one credit line per 10 steps (and the first and last), not one per step;
    then the verdict's share under mc, GAE(0.95) and td0 and one response under each."""
    from verl_ext.apps import demo

    assert demo._print_credit(trace) == STEPS
    lines = capsys.readouterr().out.splitlines()
    assert [int(line.split()[1]) for line in lines] == [1, 10, 20, STEPS]
    assert all("critic EV after the verdict" in line for line in lines)

    demo._print_side_by_side(trace, STEPS, 5)
    out = capsys.readouterr().out
    assert f"step {STEPS}" in out and f"mean of steps {STEPS - 9}-{STEPS}" in out
    header = next(line for line in out.splitlines() if line.lstrip().startswith("token_index"))
    assert header.split() == ["token_index", "token", "value", "mc", "gae0.95", "td0"]
