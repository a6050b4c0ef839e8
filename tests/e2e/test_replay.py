"""``verl-ext replay`` on real runs of verl's trainer (the runs of test_fit_with_trace.py, made once per
session, saving a checkpoint after every step): the replay with the model reproduces a step's whole
update and the parameters after it, and finds a planted change; the model-free replay of the first
mini-batch reproduces it too and equals the model's; with overrides both give what hand calculation
from the recorded columns gives, in traces the checker accepts. On the td0 run, with verl's rollout
correction (token IS and token_k1 rejection), both replays feed the recorded weights and mask, and
another correction's weights and rejection are verl's own (compute_rollout_correction_and_rejection_mask)
on the recorded log-probs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.e2e.test_fit_with_trace import MULTI_TURN, fit_group, fit_run

#: gae+dynamic_bsz is replayed model-free below too, against the model replay of its first mini-batch
REPLAYED = ["mc", MULTI_TURN, "grpo"]


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


def clip_codes_by_hand(rows, actor_settings, high: float) -> tuple[np.ndarray, np.ndarray]:
    """(the clip code of each row, its ratio) from its log-probs and advantage, by the definition: high
    where A > 0 and ratio > ``high`` (1 + ε_high), low where A < 0 and ratio < 1 − ε_low, dual where
    A < 0 and ratio > c (docs/definitions.md#the-update-token-by-token)."""
    ratio = np.exp(rows["log_prob"].to_numpy(np.float64) - rows["old_log_prob"].to_numpy(np.float64))
    advantage = rows["advantage"].to_numpy(np.float64)
    expected = np.where((advantage > 0) & (ratio > high), "high", "none")
    expected = np.where((advantage < 0) & (ratio < 1 - actor_settings["clip_ratio_low"]), "low", expected)
    return np.where((advantage < 0) & (ratio > actor_settings["clip_ratio_c"]), "dual", expected), ratio


def test_a_replay_as_recorded_reproduces_the_update_and_the_checker_accepts_its_trace(traced_run, capsys, tmp_path):
    from verl_ext.trace.reader import open_trace

    _, trace_dir = traced_run
    for step in open_trace(str(trace_dir)).steps[-1:]:  # the last: its first mini-batch follows a step of the policy
        code, out, _ = replay(capsys, trace_dir, "--step", step, "--model-free", "--out", tmp_path / f"replay-{step}")
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
    code, out, _ = replay(capsys, copy, "--step", step, "--model-free")
    sample, token = int(table["sample"][row].as_py()), int(table["token_index"][row].as_py())
    assert code == 1 and f"as recorded: DIFFERS at sample {sample}, token {token}: ratio" in out, out


def test_another_clip_range_clips_the_first_minibatch_as_hand_calculation_says(traced_run, capsys, tmp_path):
    """The clip codes under ε_high = 0.28, from the recorded log-probs and advantages by hand: high
    where A > 0 and ratio > 1.28, low where A < 0 and ratio < 1 − ε_low, dual where A < 0 and ratio > c."""
    from verl_ext.trace.reader import open_trace

    _, trace_dir = traced_run
    trace = open_trace(str(trace_dir))
    step = trace.steps[-1]
    code, out, _ = replay(capsys, trace_dir, "--step", step, "--model-free", "--out", tmp_path / "clip", "--", "actor_rollout_ref.actor.clip_ratio_high=0.28")
    assert code == 0 and "with actor_rollout_ref.actor.clip_ratio_high=0.28:" in out, out
    replayed = open_trace(str(tmp_path / "clip")).actor_update(step).to_pandas()
    assert open_trace(str(tmp_path / "clip")).record.update["actor"]["clip_ratio_high"] == 0.28
    expected, _ = clip_codes_by_hand(replayed, trace.record.update["actor"], high=1.28)
    np.testing.assert_array_equal(replayed["clip"].to_numpy().astype(str), expected)
    from verl_ext.cli import main

    assert main(["check", str(tmp_path / "clip"), "--quiet"]) == 0, capsys.readouterr().out


def test_another_loss_aggregation_gives_the_hand_aggregated_loss(traced_run, capsys):
    """seq-mean-token-mean: each micro-batch adds Σ_responses mean_t(term) / global batch size × dp."""
    from verl_ext.trace.reader import open_trace

    _, trace_dir = traced_run
    trace = open_trace(str(trace_dir))
    step = trace.steps[-1]
    code, out, _ = replay(capsys, trace_dir, "--step", step, "--model-free", "--format", "json", "--", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")
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
    code, out, _ = replay(capsys, trace_dir, "--step", step, "--model-free", "--out", tmp_path / "td0", "--", "algorithm.adv_estimator=td0")
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
def test_a_replay_it_cannot_do_is_one_line_and_exit_2(traced_run, capsys, tmp_path, monkeypatch):
    import tempfile

    from verl_ext.trace.reader import open_trace

    _, trace_dir = traced_run
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where a model replay's work directory would go
    (tmp_path / "tmp").mkdir()
    cases = {
        # issue 59: refused before anything is replayed (the first two were replayed; the third built the workers,
        # which failed, and left its work directory; the last was "not registered by its module")
        ("--step", "2", "--model-free", "--", "actor_rollout_ref.actor.clip_ratio_high=-5"): "clip_ratio_high must be > 0",
        ("--step", "2", "--model-free", "--", "algorithm.gama=0.9"): "not a key of the run's algorithm config: did you mean algorithm.gamma?",
        ("--step", "2", "--", "actor_rollout_ref.actor.ppo_epochs=abc"): "actor_rollout_ref.actor.ppo_epochs=abc: Value 'abc' of type 'str' could not be converted to Integer",
        ("--step", "2", "--", "algorithm.adv_estimator=mcc"): "algorithm.adv_estimator='mcc' is not a known advantage estimator. Valid names: ",
        ("--step", "2", "--model-free", "--", "algorithm.adv_estimator=td0"): "needs the critic's values",
        ("--step", "2", "--", "algorithm.adv_estimator=td0"): "needs the critic's values",
        ("--step", "2", "--", "actor_rollout_ref.actor.optim.lr=1e-3"): "restores the optimizer",
        ("--step", "2", "--", "actor_rollout_ref.actor.no_such_key=1"): "not a key of the run's verl config",
        ("--step", "2", "--", "trainer.total_epochs=3"): "not the run",
        ("--step", "2", "--model-free", "--checkpoint", "/x"): "choose one",
        ("--step", "2", "--checkpoint", "/nonexistent"): "no checkpoint at /nonexistent/global_step_1",
        ("--step", "2", "--model-free", "--", "actor_rollout_ref.actor.optim.lr=1e-3"): "needs the model",
        ("--step", "2", "--model-free", "--", "actor_rollout_ref.actor.clip_ratio_high=high"): "expected a number",
        ("--step", "2", "--model-free", "--", "trainer.nonsense"): "is not key=value",
        ("--step", "2", "--model-free", "--", "bogus.key=1"): "not a verl setting the replay knows",
        ("--step", "2", "--model-free", "--", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"): "does not run on the settings the trace records",
        ("--step", "2", "--model-free", "--", "actor_rollout_ref.actor.policy_loss.loss_mode=nonsense"): "Unsupported loss mode",
        ("--step", "9"): "step 9",
    }
    for argv, message in cases.items():
        code, out, err = replay(capsys, trace_dir, *argv)
        assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert not list((tmp_path / "tmp").glob("verl-ext-replay-*"))  # no work directory left behind, no log
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    code, _, err = replay(capsys, trace_dir, "--step", "2", "--model-free", "--out", tmp_path / "full")
    assert code == 2 and "not an empty directory" in err and (tmp_path / "full" / "keep.txt").read_text() == "mine"
    no_updates = tmp_path / "no_updates"
    shutil.copytree(trace_dir, no_updates)
    shutil.rmtree(no_updates / "_actor_update")
    code, _, err = replay(capsys, no_updates, "--step", "2", "--model-free")
    assert code == 2 and "has no actor update table" in err, err
    code, _, err = replay(capsys, no_updates, "--step", "2")
    assert code == 2 and "has no update tables" in err, err
    other_model = tmp_path / "other_model"
    (other_model / "global_step_1" / "actor" / "huggingface").mkdir(parents=True)
    config = json.loads((Path(open_trace(str(trace_dir)).record.model_path) / "config.json").read_text())
    (other_model / "global_step_1" / "actor" / "huggingface" / "config.json").write_text(json.dumps({**config, "hidden_size": 2 * config["hidden_size"]}))
    code, _, err = replay(capsys, trace_dir, "--step", "2", "--checkpoint", other_model)
    assert code == 2 and "holds another model than the run's" in err, err
    on_a_gpu = tmp_path / "on_a_gpu"
    shutil.copytree(trace_dir, on_a_gpu)
    record = json.loads((on_a_gpu / "_run.json").read_text())
    record["config"]["trainer"]["device"] = "cuda"
    (on_a_gpu / "_run.json").write_text(json.dumps(record))
    code, _, err = replay(capsys, on_a_gpu, "--step", "2", "--checkpoint", trace_dir.parent / "checkpoints")
    assert code == 2 and "the run trained on 'cuda'" in err and "--model-free" in err, err


# --------------------------------------------------------------------------- with the model

MODEL_REPLAYED = ["mc", MULTI_TURN, "gae+dynamic_bsz", "td0"]


@pytest.fixture(scope="module", params=[pytest.param(name, marks=fit_group(name)) for name in MODEL_REPLAYED])
def replayed_with_the_model(request, tmp_path_factory) -> tuple[Path, Path, dict]:
    """Step 2 of the run replayed with the model (from verl's checkpoint of step 1), as a trace, and the report."""
    import contextlib
    import io

    from verl_ext.cli import main

    trace_dir = fit_run(tmp_path_factory, request.param) / "trace"
    out = tmp_path_factory.mktemp("model_replay") / "replay"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["replay", str(trace_dir), "--step", "2", "--out", str(out), "--format", "json"])
    return trace_dir, out, {"code": code, **json.loads(stdout.getvalue().split("\nwritten:")[0])}


def test_the_model_replay_reproduces_the_whole_update_and_the_parameters_after_it(replayed_with_the_model, capsys):
    """Every row of both update tables (every epoch and mini-batch, as verl shuffled and micro-batched
    them) equals the recorded one, and so does every parameter of the actor and the critic after the
    step, bit for bit; the replay's trace passes the checker (its logged metrics are the replayed
    update's, which the per-token terms must reproduce)."""
    from verl_ext.cli import main
    from verl_ext.trace.reader import open_trace

    trace_dir, out, report = replayed_with_the_model
    assert report["code"] == 0 and report["mode"] == "model" and report["as_recorded"] == "REPRODUCED", report
    trace, written = open_trace(str(trace_dir)), open_trace(str(out))
    for kind in ("actor", "critic"):
        recorded, replayed = trace.update_table(kind, 2).to_pandas(), written.update_table(kind, 2).to_pandas()
        assert len(recorded) and report["bitwise"][kind] == [len(recorded), len(recorded)]
        assert recorded.drop(columns=["step"]).equals(replayed.drop(columns=["step"])), kind
        equal, tensors, largest = report["parameters"][kind]
        assert equal == tensors > 0 and largest == 0
    assert written.record.replay["mode"] == "model" and written.record.replay["minibatches"] is None
    assert main(["check", str(out), "--quiet"]) == 0, capsys.readouterr().out


def test_the_model_free_replay_equals_the_model_replay_on_the_first_minibatch(replayed_with_the_model, capsys, tmp_path):
    from verl_ext.trace.reader import open_trace

    trace_dir, out, _ = replayed_with_the_model
    code, _, _ = replay(capsys, trace_dir, "--step", 2, "--model-free", "--out", tmp_path / "free")
    assert code == 0
    free = open_trace(str(tmp_path / "free")).actor_update(2).to_pandas()
    model = open_trace(str(out)).actor_update(2).to_pandas()
    model = model[first_minibatch(model)].reset_index(drop=True)
    assert len(free) == len(model) > 0
    for column in ("sample", "token_index", "log_prob", "ratio", "clip", "pg_loss", "advantage", "is_weight"):
        np.testing.assert_array_equal(free[column].to_numpy(), model[column].to_numpy(), err_msg=column)


@pytest.mark.parametrize("traced_run", [pytest.param("mc", marks=fit_group("mc"))], indirect=True)
def test_a_planted_checkpoint_is_found(traced_run, capsys, tmp_path):
    """A replay that cannot fail proves nothing: one parameter of verl's checkpoint after step 2 changed in
    a copy is reported as a parameter that differs (exit 1), and a copy of the checkpoint before step 2
    with one parameter changed makes the update tables differ."""
    import torch

    _, trace_dir = traced_run
    checkpoints = trace_dir.parent / "checkpoints"
    for planted_step, finding in ((2, "actor 20 of 21 tensors bit for bit"), (1, "as recorded: DIFFERS at")):
        copy = tmp_path / f"planted-{planted_step}"
        shutil.copytree(checkpoints, copy)
        model_file = copy / f"global_step_{planted_step}" / "actor" / "model_world_size_1_rank_0.pt"
        state = torch.load(model_file, weights_only=False)
        name = next(name for name in state if name.endswith("norm.weight"))
        with torch.no_grad():
            state[name].to_local()[0] += 0.25
        torch.save(state, model_file)
        code, out, err = replay(capsys, trace_dir, "--step", 2, "--checkpoint", copy)
        assert code == 1 and finding in out, out + err


@pytest.mark.parametrize("traced_run", [pytest.param("mc", marks=fit_group("mc"))], indirect=True)
def test_the_model_replay_with_another_clip_range_clips_as_hand_calculation_says(traced_run, capsys, tmp_path):
    """With ε_high = 0.28 every row of every epoch carries the clip code the formula gives from its own
    log-probs and advantage, the replay's trace passes the checker, and the policy after the step moved."""
    from verl_ext.cli import main
    from verl_ext.trace.reader import open_trace

    _, trace_dir = traced_run
    code, out, _ = replay(capsys, trace_dir, "--step", 2, "--out", tmp_path / "clip", "--format", "json", "--",
                          "actor_rollout_ref.actor.clip_ratio_high=0.28")  # fmt: skip
    report = json.loads(out.split("\nwritten:")[0])
    assert code == 0 and report["as_recorded"] is None
    written = open_trace(str(tmp_path / "clip"))
    assert written.record.update["actor"]["clip_ratio_high"] == 0.28
    rows = written.actor_update(2).to_pandas()
    expected, ratio = clip_codes_by_hand(rows, written.record.update["actor"], high=1.28)
    decided = np.abs(ratio - 1.28) > 1e-5  # a ratio on the boundary rounds either way
    np.testing.assert_array_equal(rows["clip"].to_numpy().astype(str)[decided], expected[decided])
    assert main(["check", str(tmp_path / "clip"), "--quiet"]) == 0, capsys.readouterr().out


@pytest.mark.parametrize("name", [pytest.param(name, marks=fit_group(name)) for name in MODEL_REPLAYED])
def test_step_1_replays_from_the_model_the_config_names_and_gives_the_same_report_twice(name, capsys, tmp_path_factory):
    """Step 1 starts from the models the config names: the actor's checkpoint whole, the critic's without
    its value head, which verl draws at random when it builds the critic (the CPU backend from
    critic.fsdp.seed). Both update tables and every parameter after the step equal the run's (padded,
    multi-turn with holes, micro-batches packed by token count), and the same replay twice prints the
    same report, byte for byte."""
    trace_dir = fit_run(tmp_path_factory, name) / "trace"
    reports = []
    for _ in range(2 if name == "mc" else 1):
        code, out, _ = replay(capsys, trace_dir, "--step", 1)
        assert code == 0 and "as recorded: REPRODUCED" in out, out
        reports.append(out)
    assert reports[0] == reports[-1]
    rows = {kind: len(open_trace_at(trace_dir).update_table(kind, 1)) for kind in ("actor", "critic")}
    assert f"actor {rows['actor']} of {rows['actor']} rows bit for bit, critic {rows['critic']} of {rows['critic']} rows bit for bit" in reports[0]
    assert "critic 22 of 22 tensors bit for bit (max |Δ| 0), actor 21 of 21 tensors bit for bit (max |Δ| 0)" in reports[0], reports[0]


def open_trace_at(path):
    from verl_ext.trace.reader import open_trace

    return open_trace(str(path))


@pytest.mark.parametrize("traced_run", [pytest.param("mc", marks=fit_group("mc"))], indirect=True)
def test_step_1_of_a_run_whose_initial_critic_cannot_be_rebuilt_is_one_line_and_exit_2(traced_run, capsys, tmp_path, assets, monkeypatch):
    """A critic built for step 1 that is not the run's (its values on step 1 differ from the recorded ones)
    is said in one line, exit 2, the same twice, and leaves no work directory: a value head the run drew
    from another seed than its recorded config names (as a run before the CPU backend seeded it drew it,
    unseeded), and a model path that holds another critic now (the task's pretrained one, with its head)."""
    import tempfile

    _, trace_dir = traced_run
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the replay makes its work directory
    cases = {
        ("critic", "fsdp", "seed"): (43, ["drawn at random (score.weight, score.bias, which", "not from critic.fsdp.seed=43",
                                          "--model-free", "critic.model.path holds the value head"]),
        ("critic", "model", "path"): (str(assets.critic_dir), [f"the critic at {assets.critic_dir} (critic.model.path) is not the one the run started from"]),
    }  # fmt: skip
    for (*keys, last), (value, messages) in cases.items():
        copy = tmp_path / last
        shutil.copytree(trace_dir, copy)
        record = json.loads((copy / "_run.json").read_text())
        node = record["config"]
        for key in keys:
            node = node[key]
        node[last] = value
        (copy / "_run.json").write_text(json.dumps(record))
        said = []
        for _ in range(2):
            code, out, err = replay(capsys, copy, "--step", 1, "--checkpoint", trace_dir.parent / "checkpoints")
            progress, *said_in = err.strip().splitlines()  # the line before the workers' process starts, then theirs
            assert code == 2 and out == "" and progress.startswith("replay: step 1 with verl's workers") and len(said_in) == 1, (last, out, err)
            assert said_in[0].startswith("verl-ext replay: step 1 cannot be replayed with the model"), err
            assert all(message in said_in[0] for message in messages), err
            said.append(err)
        assert said[0] == said[1] and not any((tmp_path / "tmp").iterdir())


@pytest.mark.parametrize("traced_run", [pytest.param("mc", marks=fit_group("mc"))], indirect=True)
def test_another_number_of_epochs_reports_the_clip_codes_of_the_epoch_only_one_update_ran(traced_run, capsys, tmp_path):
    """The run trained 2 PPO epochs. With 3, epoch 2 is only in the replay; with 1, epoch 1 is only in the
    recorded update: the report counts that epoch's tokens and clip codes as its update table holds them
    (counted here from the table), and compares the epochs both ran token by token (here by hand: no
    token of them changed its code, as the update up to there is the run's)."""
    from collections import Counter

    _, trace_dir = traced_run
    recorded = open_trace_at(trace_dir).actor_update(2).to_pandas()

    def codes(table, epoch):
        rows = table[table["epoch"] == epoch]
        return len(rows), dict(sorted(Counter(code for code in rows["clip"].astype(str) if code != "none").items()))

    def by_token(table):
        return {(e, s, t): c for e, s, t, c in zip(table["epoch"], table["sample"], table["token_index"], table["clip"].astype(str))}

    code, out, _ = replay(capsys, trace_dir, "--step", 2, "--out", tmp_path / "three", "--", "actor_rollout_ref.actor.ppo_epochs=3")
    replayed = open_trace_at(tmp_path / "three").actor_update(2).to_pandas()
    tokens, clipped = codes(replayed, 2)
    assert code == 0 and tokens == codes(recorded, 0)[0] > 0 and sorted(set(replayed["epoch"])) == [0, 1, 2]
    shared = {key: value for key, value in by_token(replayed).items() if key[0] < 2}
    assert shared == by_token(recorded)  # epochs 0 and 1 as the run trained them: no clip code changed
    where = ", ".join(f"{name} on {n}" for name, n in clipped.items())
    line = f"  clip codes changed: none (on epochs 0, 1, which both updates ran); epoch 2 is only in the replay: {sum(clipped.values())} of its {tokens} tokens clipped"
    assert line + (f" ({where})" if clipped else "") + "\n" in out, out

    code, out, _ = replay(capsys, trace_dir, "--step", 2, "--format", "json", "--", "actor_rollout_ref.actor.ppo_epochs=1")
    report = json.loads(out)
    tokens, clipped = codes(recorded, 1)
    assert code == 0 and report["clip_only"] == {"recorded": {"1": {"tokens": tokens, "clipped": clipped, "whole": True}}}, report["clip_only"]
    assert report["clip_changes"] == {} and sum(clipped.values()) > 0  # the run's epoch 1 clipped (clip_ratio 0.1, lr 1e-2)


# --------------------------------------------------------------------------- verl's rollout correction (the td0 run)

CORRECTED = "td0"


@pytest.fixture(scope="module")
def corrected_run(tmp_path_factory) -> Path:
    """The td0 run's trace: token IS weights truncated at 2, token_k1 rejection (test_fit_with_trace.CORRECTION)."""
    return fit_run(tmp_path_factory, CORRECTED) / "trace"


def dense(tokens, column: str, fill=0.0, dtype=np.float32) -> np.ndarray:
    """A token-table column as the (samples, positions) matrix verl's batch holds it in (``fill`` elsewhere)."""
    matrix = np.full((tokens["sample"].max() + 1, tokens["token_index"].max() + 1), fill, dtype)
    matrix[tokens["sample"], tokens["token_index"]] = tokens[column].to_numpy(dtype)
    return matrix


def verls_correction(tokens, **settings):
    """verl's own weights and mask after rejection (rollout_corr_helper.compute_rollout_correction_and_rejection_mask)
    from the recorded old and rollout log-probs over the policy's own tokens (mask ∨ rejected), at the table's rows."""
    import torch
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    own = tokens.assign(own=tokens["mask"] | tokens["rejected"].fillna(False).astype(bool))
    weights, mask, _ = compute_rollout_correction_and_rejection_mask(
        old_log_prob=torch.from_numpy(dense(tokens, "old_log_prob")), rollout_log_prob=torch.from_numpy(dense(tokens, "rollout_log_prob")),
        response_mask=torch.from_numpy(dense(own, "own")), **settings,
    )  # fmt: skip
    at = (tokens["sample"].to_numpy(), tokens["token_index"].to_numpy())
    return (None if weights is None else weights.batch["rollout_is_weights"].numpy()[at]), mask.numpy()[at] > 0.5, own["own"].to_numpy()


def td0_whitened_by_hand(tokens, keep: np.ndarray, gamma: float) -> dict[tuple[int, int], float]:
    """td0 over the kept tokens (docs/definitions.md#off-policy-tokens: a rejected token is skipped, V_{t+1} is the
    next kept token's, 0 after the last): δ_t = r_t + γ·V_next − V_t, whitened over the step's kept tokens."""
    deltas = {}
    for sample, rows in tokens[keep].groupby("sample"):
        reward, value = rows["reward"].to_numpy(np.float64), rows["value"].to_numpy(np.float64)
        for index, delta in zip(rows["token_index"], reward + gamma * np.append(value[1:], 0.0) - value):
            deltas[(sample, index)] = delta
    raw = np.array(list(deltas.values()))
    return dict(zip(deltas, (raw - raw.mean()) / np.sqrt(raw.var(ddof=1) + 1e-8)))


@pytest.mark.xdist_group(f"fit_with_trace-{CORRECTED}")
def test_the_model_free_replay_feeds_the_token_tables_weights(corrected_run, capsys, tmp_path):
    """As recorded the model-free replay multiplies the token table's rollout_is_weight into the loss, as the model
    replay puts it on the batch: REPRODUCED on the run (the update table's is_weight is the same number), and a weight
    planted in a copy of the token table is found at its token (exit 1). The recorded weights are verl's own on the
    recorded log-probs, and the run rejected tokens: the replay has something to honour."""
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(corrected_run))
    step = trace.steps[-1]
    tokens = trace.read_step(step).to_pandas()
    weights, mask, _ = verls_correction(tokens, rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                                        rollout_rs_threshold="0.9999995_1.0000005")  # fmt: skip
    np.testing.assert_array_equal(tokens["rollout_is_weight"].to_numpy(np.float32), weights)
    np.testing.assert_array_equal(tokens["mask"].to_numpy(), mask)
    assert tokens["rejected"].sum() > 0
    code, out, _ = replay(capsys, corrected_run, "--step", step, "--model-free")
    assert code == 0 and "as recorded: REPRODUCED" in out and "the token table's rollout_is_weight the weights it multiplied in" in out, out

    copy = tmp_path / "planted"
    shutil.copytree(corrected_run, copy)
    update = trace.actor_update(step).to_pandas()
    sample, token = (int(v) for v in update[first_minibatch(trace.actor_update(step))].iloc[3][["sample", "token_index"]])
    path = copy / trace.layout.token_file(step)
    table = pq.read_table(path)
    row = int(np.flatnonzero((table["sample"].to_numpy() == sample) & (table["token_index"].to_numpy() == token))[0])
    planted = table["rollout_is_weight"].to_numpy().copy()
    planted[row] *= 1.5
    field = table.schema.field("rollout_is_weight")
    pq.write_table(table.set_column(table.schema.get_field_index("rollout_is_weight"), field, [planted]).replace_schema_metadata(table.schema.metadata), path)
    code, out, _ = replay(capsys, copy, "--step", step, "--model-free")
    assert code == 1 and f"as recorded: DIFFERS at sample {sample}, token {token}: is_weight" in out, out


@pytest.mark.xdist_group(f"fit_with_trace-{CORRECTED}")
def test_another_rollout_correction_model_free_is_verls_weights_and_rejection_on_the_recorded_log_probs(corrected_run, capsys, tmp_path):
    """A tighter rejection and a TIS bound below 1: the replay's token table holds the mask, rejected tokens and
    weights verl's compute_rollout_correction_and_rejection_mask gives on the recorded log-probs (bit for bit); the
    first mini-batch trains the kept tokens of its samples, with td0's advantages re-estimated by hand over the kept
    tokens and the new weights; its loss is token-mean's −Σ A·w / (trained tokens) (the ratio is 1 there); the report
    counts what changed; the checker accepts the trace."""
    from verl_ext.cli import main
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(corrected_run))
    step = trace.steps[-1]
    bounds = "0.9999998_1.0000002"
    code, out, _ = replay(capsys, corrected_run, "--step", step, "--model-free", "--format", "json", "--out", tmp_path / "what-if", "--",
                          f"algorithm.rollout_correction.rollout_rs_threshold='{bounds}'", "algorithm.rollout_correction.rollout_is_threshold=0.9999998")  # fmt: skip
    report = json.loads(out.split("\nwritten:")[0])
    assert code == 0 and report["as_recorded"] == "REPRODUCED", out
    recorded = trace.read_step(step).to_pandas()
    weights, keep, own = verls_correction(recorded, rollout_is="token", rollout_is_threshold=0.9999998, rollout_rs="token_k1",
                                          rollout_rs_threshold=bounds)  # fmt: skip
    written = open_trace(str(tmp_path / "what-if"))
    tokens = written.read_step(step).to_pandas()
    np.testing.assert_array_equal(tokens["mask"].to_numpy(), keep)
    np.testing.assert_array_equal(tokens["rejected"].to_numpy(bool), own & ~keep)
    np.testing.assert_array_equal(tokens["rollout_is_weight"].to_numpy(np.float32), weights)
    was = recorded["mask"].to_numpy()
    key = lambda where: sorted(map(list, zip(recorded["sample"][where], recorded["token_index"][where])))  # noqa: E731
    correction = report["correction"]
    assert sorted(correction["newly_rejected"]) == key(was & ~keep) != [] and correction["newly_kept"] == key(~was & keep) == []
    assert correction["rejected"] == [int((own & ~was).sum()), int((own & ~keep).sum())]
    assert written.record.algorithm["rollout_correction"]["is_upper"] == 0.9999998

    rows = written.actor_update(step).to_pandas()
    recorded_rows = trace.actor_update(step).to_pandas()
    recorded_rows = recorded_rows[first_minibatch(trace.actor_update(step))]
    kept = recorded[keep & recorded["sample"].isin(recorded_rows["sample"]).to_numpy()]
    assert sorted(zip(rows["sample"], rows["token_index"])) == sorted(zip(kept["sample"], kept["token_index"]))
    at = {(s, t): w for s, t, w in zip(recorded["sample"], recorded["token_index"], weights)}
    np.testing.assert_array_equal(rows["is_weight"].to_numpy(np.float32), np.array([at[k] for k in zip(rows["sample"], rows["token_index"])], np.float32))
    by_hand = td0_whitened_by_hand(recorded, keep, trace.record.algorithm["gamma"])
    advantage = np.array([by_hand[k] for k in zip(rows["sample"], rows["token_index"])])
    np.testing.assert_allclose(rows["advantage"].to_numpy(np.float64), advantage, rtol=1e-5, atol=1e-5)
    assert (rows["ratio"] == 1).all() and trace.record.update["actor"]["loss_agg_mode"] == "token-mean"
    loss = -(advantage * rows["is_weight"].to_numpy(np.float64)).sum() / len(rows)
    assert report["loss"][1] == pytest.approx(loss, rel=1e-5) and report["trained"]["replayed"] == len(rows)
    assert main(["check", str(tmp_path / "what-if"), "--quiet"]) == 0, capsys.readouterr().out


@pytest.mark.xdist_group(f"fit_with_trace-{CORRECTED}")
def test_another_rollout_correction_with_the_model_trains_what_it_keeps(corrected_run, capsys, tmp_path):
    """No rejection and a TIS bound below 1, with verl's workers: every token of the policy's is trained in every
    epoch (the run's rejected ones too, where verl's own mini-batching put them), with verl's weights on the recorded
    log-probs as the loss's is_weight; the critic trains on them too; the checker accepts the replay's trace."""
    from verl_ext.cli import main
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(corrected_run))
    step = trace.steps[-1]
    code, out, _ = replay(capsys, corrected_run, "--step", step, "--format", "json", "--out", tmp_path / "what-if", "--",
                          "algorithm.rollout_correction.rollout_rs=null", "algorithm.rollout_correction.rollout_is_threshold=0.9999998")  # fmt: skip
    report = json.loads(out.split("\nwritten:")[0])
    assert code == 0 and report["as_recorded"] is None, out
    recorded = trace.read_step(step).to_pandas()
    weights, keep, own = verls_correction(recorded, rollout_is="token", rollout_is_threshold=0.9999998)
    assert (keep == own).all() and (own & ~recorded["mask"].to_numpy()).sum() > 0
    assert sorted(report["correction"]["newly_kept"]) == sorted(map(list, zip(recorded["sample"][own & ~recorded["mask"]], recorded["token_index"][own & ~recorded["mask"]])))
    written = open_trace(str(tmp_path / "what-if"))
    at = {(s, t): w for s, t, w in zip(recorded["sample"], recorded["token_index"], weights)}
    expected = sorted(zip(recorded["sample"][own], recorded["token_index"][own]))
    actor, critic = written.actor_update(step).to_pandas(), written.critic_update(step).to_pandas()
    assert sorted(set(actor["epoch"])) == [0, 1] and len(set(critic["epoch"])) > 0
    for epoch, rows in actor.groupby("epoch"):
        assert sorted(zip(rows["sample"], rows["token_index"])) == expected, epoch
        np.testing.assert_array_equal(rows["is_weight"].to_numpy(np.float32), np.array([at[k] for k in zip(rows["sample"], rows["token_index"])], np.float32))
    for epoch, rows in critic.groupby("epoch"):
        assert sorted(zip(rows["sample"], rows["token_index"])) == expected, epoch
    assert main(["check", str(tmp_path / "what-if"), "--quiet"]) == 0, capsys.readouterr().out


@pytest.mark.xdist_group(f"fit_with_trace-{CORRECTED}")
def test_a_rollout_correction_verl_refuses_is_one_line_and_exit_2(corrected_run, capsys):
    """A value verl's rollout correction refuses, a key it lacks, and bypass mode (computed inside the loss against
    π_θ, which the recorded log-probs cannot give): one line, exit 2, with and without the model."""
    cases = {
        ("--model-free", "--", "algorithm.rollout_correction.rollout_is_threshold=abc"): "algorithm.rollout_correction.rollout_is_threshold: 'abc' is not a number",
        ("--", "algorithm.rollout_correction.rollout_is_threshold=abc"): "algorithm.rollout_correction.rollout_is_threshold: 'abc' is not a number",
        ("--model-free", "--", "algorithm.rollout_correction.rollout_rs=token_k9"): "algorithm.rollout_correction.rollout_rs: 'token_k9' is not one of",
        ("--model-free", "--", "algorithm.rollout_correction.rollout_rs_threshold='2_1'"): "lower bound exceeds its upper bound",
        ("--model-free", "--", "algorithm.rollout_correction.rollout_is=seq"): "algorithm.rollout_correction.rollout_is: 'seq' is not null, 'token' or 'sequence'",
        ("--model-free", "--", "algorithm.rollout_correction.bypass_mode=true"): "override algorithm.rollout_correction.bypass_mode: bypass mode computes",
        ("--", "algorithm.rollout_correction.loss_type=reinforce"): "override algorithm.rollout_correction.loss_type: bypass mode computes",
        ("--model-free", "--", "algorithm.rollout_correction.rollout_is_treshold=1.5"): "did you mean algorithm.rollout_correction.rollout_is_threshold?",
    }
    for argv, message in cases.items():
        code, out, err = replay(capsys, corrected_run, "--step", 2, *argv)
        assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, (argv, err)


@pytest.mark.parametrize("traced_run", [pytest.param("gae_ext", marks=fit_group("gae_ext"))], indirect=True)
def test_a_bypass_run_replays_as_recorded_and_refuses_another_correction(traced_run, capsys):
    """The gae_ext run is in verl's bypass mode (old log-probs = the rollout's, the mask not rejected, no weight on
    the batch; verl 0.9.1's workers train vanilla PPO there: docs/definitions.md#off-policy-tokens). The model-free
    replay feeds what the trace holds and reproduces the first mini-batch with no weight; another correction, which
    verl would compute inside the loss against π_θ, is one line, exit 2."""
    from verl_ext.trace.reader import open_trace

    _, trace_dir = traced_run
    trace = open_trace(str(trace_dir))
    step = trace.steps[-1]
    assert trace.record.algorithm["rollout_correction"]["bypass_mode"] is True
    code, out, err = replay(capsys, trace_dir, "--step", step, "--model-free", "--", "algorithm.rollout_correction.rollout_is=token")
    assert code == 2 and out == "" and "the run is in bypass mode" in err and len(err.strip().splitlines()) == 1, err
    code, out, _ = replay(capsys, trace_dir, "--step", step, "--model-free", "--format", "json")
    report = json.loads(out)
    assert code == 0 and report["as_recorded"] == "REPRODUCED" and report["weights"] is None, out
