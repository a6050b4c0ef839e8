"""``verl-ext replay`` on real runs of verl's trainer (the runs of test_fit_with_trace.py, made once per
session): the model-free replay of a step's first mini-batch reproduces the recorded update, finds a
planted change, and with overrides gives what hand calculation from the recorded columns gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.e2e.test_fit_with_trace import MULTI_TURN, fit_group, fit_run

REPLAYED = ["mc", MULTI_TURN, "gae+dynamic_bsz", "grpo"]


@pytest.fixture(scope="module", params=[pytest.param(name, marks=fit_group(name)) for name in REPLAYED])
def traced_run(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, fit_run(tmp_path_factory, request.param) / "trace"


def replay(capsys, *argv: str) -> tuple[int, str, str]:
    from verl_ext.cli import main

    code = main(["replay", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def first_minibatch(table) -> np.ndarray:
    return (table["epoch"].to_numpy() == 0) & (table["minibatch"].to_numpy() == 0)


def test_a_replay_as_recorded_reproduces_the_update_and_the_checker_accepts_its_trace(traced_run, capsys, tmp_path):
    from verl_ext.trace.reader import open_trace

    _, trace_dir = traced_run
    for step in open_trace(str(trace_dir)).steps:
        code, out, _ = replay(capsys, trace_dir, "--step", step, "--out", tmp_path / f"replay-{step}")
        assert code == 0 and "as recorded: REPRODUCED" in out, out
        recorded = open_trace(str(trace_dir)).actor_update(step).to_pandas()
        written = open_trace(str(tmp_path / f"replay-{step}"))
        assert written.record.replay["step"] == step and written.steps == [step]
        replayed = written.actor_update(step).to_pandas()
        expected = recorded[first_minibatch(recorded)]
        assert len(replayed) == len(expected) > 0
        for column in ("sample", "token_index", "ratio", "pg_loss", "clip", "log_prob", "advantage"):
            np.testing.assert_array_equal(replayed[column].to_numpy(), expected[column].to_numpy(), err_msg=column)
        from verl_ext.cli import main

        assert main(["check", str(tmp_path / f"replay-{step}"), "--quiet"]) == 0, capsys.readouterr().out


def test_a_planted_log_prob_is_found_where_it_was_planted(traced_run, capsys, tmp_path):
    """A replay that cannot fail proves nothing: a log-prob of the first mini-batch moved by 0.1 in a
    copy of the trace is reported at its token, in the ratio column, with exit code 1."""
    from verl_ext.trace.reader import open_trace

    _, trace_dir = traced_run
    copy = tmp_path / "planted"
    shutil.copytree(trace_dir, copy)
    trace = open_trace(str(copy))
    step = trace.steps[-1]
    path = copy / trace.layout.update_file("actor", step)
    table = pq.read_table(path)
    rows = np.flatnonzero(first_minibatch(table))
    row = int(rows[len(rows) // 2])
    log_prob = table["log_prob"].to_numpy().copy()
    log_prob[row] += 0.1
    table = table.set_column(table.schema.get_field_index("log_prob"), table.schema.field("log_prob"), [log_prob])
    pq.write_table(table, path)
    code, out, _ = replay(capsys, copy, "--step", step)
    sample, token = int(table["sample"][row].as_py()), int(table["token_index"][row].as_py())
    assert code == 1 and f"as recorded: DIFFERS at sample {sample}, token {token}: ratio" in out, out


def test_another_clip_range_clips_the_first_minibatch_as_hand_calculation_says(traced_run, capsys, tmp_path):
    """The clip codes under ε_high = 0.28, from the recorded log-probs and advantages by hand: high
    where A > 0 and ratio > 1.28, low where A < 0 and ratio < 1 − ε_low, dual where A < 0 and ratio > c."""
    from verl_ext.trace.reader import open_trace

    _, trace_dir = traced_run
    trace = open_trace(str(trace_dir))
    step = trace.steps[-1]
    code, out, _ = replay(capsys, trace_dir, "--step", step, "--out", tmp_path / "clip", "--", "actor_rollout_ref.actor.clip_ratio_high=0.28")
    assert code == 0 and "with actor_rollout_ref.actor.clip_ratio_high=0.28:" in out, out
    replayed = open_trace(str(tmp_path / "clip")).actor_update(step).to_pandas()
    assert open_trace(str(tmp_path / "clip")).record.update["actor"]["clip_ratio_high"] == 0.28
    low, c = trace.record.update["actor"]["clip_ratio_low"], trace.record.update["actor"]["clip_ratio_c"]
    ratio = np.exp(replayed["log_prob"].to_numpy(np.float64) - replayed["old_log_prob"].to_numpy(np.float64))
    advantage = replayed["advantage"].to_numpy(np.float64)
    expected = np.where((advantage > 0) & (ratio > 1.28), "high", "none")
    expected = np.where((advantage < 0) & (ratio < 1 - low), "low", expected)
    expected = np.where((advantage < 0) & (ratio > c), "dual", expected)
    np.testing.assert_array_equal(replayed["clip"].to_numpy().astype(str), expected)
    from verl_ext.cli import main

    assert main(["check", str(tmp_path / "clip"), "--quiet"]) == 0, capsys.readouterr().out


def test_another_loss_aggregation_gives_the_hand_aggregated_loss(traced_run, capsys):
    """seq-mean-token-mean: each micro-batch adds Σ_responses mean_t(term) / global batch size × dp."""
    from verl_ext.trace.reader import open_trace

    _, trace_dir = traced_run
    trace = open_trace(str(trace_dir))
    step = trace.steps[-1]
    code, out, _ = replay(capsys, trace_dir, "--step", step, "--format", "json", "--", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")
    report = json.loads(out)
    table = trace.actor_update(step).to_pandas()
    rows = table[first_minibatch(table)]
    info = next(m for m in trace.update_record("actor", step).minibatches if (m["epoch"], m["minibatch"]) == (0, 0))
    per_response = rows.groupby(["rank", "microbatch", "sample"])["pg_loss"].apply(lambda terms: terms.to_numpy(np.float64).mean())
    expected = per_response.sum() / info["global_batch_size"] * info["dp_size"]
    assert code == 0 and report["as_recorded"] == "REPRODUCED"
    assert report["loss"][1] == pytest.approx(expected, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("traced_run", [pytest.param("mc", marks=fit_group("mc"))], indirect=True)
def test_td0_instead_of_mc_gives_hand_computed_whitened_td_errors(traced_run, capsys, tmp_path):
    """td0's raw advantage δ_t = r_t + γ·V(s_{t+1}) − V(s_t) (V = 0 after the last token), whitened
    over the step's valid tokens ((δ − μ)/sqrt(σ² + 1e-8), σ² unbiased): computed here from the token
    table's reward and value, and compared with the replay's advantages and its written token table."""
    from verl_ext.trace.reader import open_trace

    _, trace_dir = traced_run
    trace = open_trace(str(trace_dir))
    step, gamma = trace.steps[-1], trace.record.algorithm["gamma"]
    code, out, _ = replay(capsys, trace_dir, "--step", step, "--out", tmp_path / "td0", "--", "algorithm.adv_estimator=td0")
    assert code == 0 and "with algorithm.adv_estimator=td0:" in out, out
    tokens = trace.read_step(step).to_pandas()
    tokens = tokens[tokens["mask"]]
    deltas = {}
    for sample, rows in tokens.groupby("sample"):
        reward, value = rows["reward"].to_numpy(np.float64), rows["value"].to_numpy(np.float64)
        after = np.append(value[1:], 0.0)
        for index, delta in zip(rows["token_index"], reward + gamma * after - value):
            deltas[(sample, index)] = delta
    raw = np.array(list(deltas.values()))
    white = (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8)
    expected = dict(zip(deltas, white))
    written = open_trace(str(tmp_path / "td0"))
    replayed = written.actor_update(step).to_pandas()
    got = replayed["advantage"].to_numpy(np.float64)
    want = np.array([expected[(s, t)] for s, t in zip(replayed["sample"], replayed["token_index"])])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert written.record.algorithm["adv_estimator"] == "td0"
    from verl_ext.cli import main

    assert main(["check", str(tmp_path / "td0"), "--quiet"]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("traced_run", [pytest.param("grpo", marks=fit_group("grpo"))], indirect=True)
def test_a_replay_it_cannot_do_is_one_line_and_exit_2(traced_run, capsys, tmp_path):
    _, trace_dir = traced_run
    cases = {
        ("--step", "2", "--", "algorithm.adv_estimator=td0"): "needs the critic's values",
        ("--step", "2", "--", "actor_rollout_ref.actor.optim.lr=1e-3"): "needs the model",
        ("--step", "2", "--", "actor_rollout_ref.actor.clip_ratio_high=high"): "expected a number",
        ("--step", "2", "--", "trainer.nonsense"): "is not key=value",
        ("--step", "2", "--", "bogus.key=1"): "not a verl setting the replay knows",
        ("--step", "2", "--", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"): "does not run on the settings the trace records",
        ("--step", "2", "--", "actor_rollout_ref.actor.policy_loss.loss_mode=nonsense"): "Unsupported loss mode",
        ("--step", "9"): "step 9",
    }
    for argv, message in cases.items():
        code, out, err = replay(capsys, trace_dir, *argv)
        assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, (argv, err)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    code, _, err = replay(capsys, trace_dir, "--step", "2", "--out", tmp_path / "full")
    assert code == 2 and "not an empty directory" in err and (tmp_path / "full" / "keep.txt").read_text() == "mine"
    no_updates = tmp_path / "no_updates"
    shutil.copytree(trace_dir, no_updates)
    shutil.rmtree(no_updates / "_actor_update")
    code, _, err = replay(capsys, no_updates, "--step", "2")
    assert code == 2 and "has no actor update table" in err, err
