"""The update tables, worked by hand: two samples of three tokens, two PPO epochs of two mini-batches
(one sample each), vanilla PPO with ε = 0.2 and dual clip c = 3, value clip ε_v = 0.5. The update
tables go through the real TraceWriter and reader; every expected number below is computed by hand.

Actor: old_log_prob = −1 everywhere; the ratio is 1 (epoch 0, sample 0), 1.5 (epoch 0, sample 1),
0.5 (epoch 1, sample 0) and 3.5 (epoch 1, sample 1). With pg1 = −A·r, pg2 = −A·clip(r, 0.8, 1.2),
l1 = max(pg1, pg2), term = min(l1, −3A) for A < 0:

    sample 0, A = [1, −1, 0.5]      r = 1:   terms [−1, 1, −0.5]          none, none, none
                                    r = 0.5: terms [−0.5, 0.8, −0.25]     none, low, none
    sample 1, A = [−0.5, 2, −2]     r = 1.5: terms [0.75, −2.4, 3]        none, high, none
                                    r = 3.5: terms [1.5, −2.4, 6]         dual, high, dual

token-mean per mini-batch: −1/6, 0.45, 1/60, 1.7 → actor/pg_loss = 0.5; clip fractions per
mini-batch 0, 1/3, 1/3, 1/3 → actor/pg_clipfrac = 0.25; dual 0, 0, 0, 2/3 → pg_clipfrac_lower = 1/6.

Critic (both epochs alike): value V = [0, 0, 1], vpred = [0.2, 1.0, 0.0], return R = [0, 1, 1]:
clip(vpred, V ± 0.5) = [0.2, 0.5, 0.5]; (vpred − R)² = [0.04, 0, 1], (clipped − R)² = [0.04, 0.25,
0.25]; terms max = [0.04, 0.25, 1], clipped chosen [no, yes, no] → critic/vf_loss = ½ · mean over
mini-batches (the same two rows) = ½ · 1.29/3 = 0.215, vf_clipfrac = 1/3.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.inspect.inspect_helpers import algorithm, random_batch, write_trace

from verl_ext.check.run import check_trace
from verl_ext.inspect.summary import summarize
from verl_ext.trace.update_files import UpdateCapture
from verl_ext.trace.reader import open_trace

ADVANTAGES = [[1.0, -1.0, 0.5], [-0.5, 2.0, -2.0]]
RATIOS = {(0, 0): 1.0, (0, 1): 1.5, (1, 0): 0.5, (1, 1): 3.5}  # (epoch, sample) -> ratio
TERMS = {(0, 0): [-1, 1, -0.5], (0, 1): [0.75, -2.4, 3], (1, 0): [-0.5, 0.8, -0.25], (1, 1): [1.5, -2.4, 6]}
CLIPS = {
    (0, 0): ["none"] * 3, (0, 1): ["none", "high", "none"],
    (1, 0): ["none", "low", "none"], (1, 1): ["dual", "high", "dual"],
}  # fmt: skip
SETTINGS = {
    "actor": {"loss_mode": "vanilla", "loss_agg_mode": "token-mean", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0},
    "critic": {"cliprange_value": 0.5, "loss_agg_mode": "token-mean"},
}  # fmt: skip
LOGGED = {
    "actor": {"actor/pg_loss": 0.5, "actor/pg_clipfrac": 0.25, "actor/pg_clipfrac_lower": 1 / 6},
    "critic": {"critic/vf_loss": 0.215, "critic/vf_clipfrac": 1 / 3},
}


def part(epoch: int, sample: int, columns: dict) -> dict:
    return {
        "epoch": epoch, "minibatch": sample, "microbatch": 0, "rank": 0, "batch_num_tokens": 3,
        "global_batch_size": 1, "dp_size": 1,
        "columns": {"sample": np.full(3, sample, np.int32), "token_index": np.arange(3, dtype=np.int32), **columns},
    }  # fmt: skip


def actor_part(epoch: int, sample: int) -> dict:
    ratio = RATIOS[epoch, sample]
    return part(epoch, sample, {
        "log_prob": np.full(3, -1 + math.log(ratio), np.float32),
        "old_log_prob": np.full(3, -1.0, np.float32),
        "ratio": np.full(3, ratio, np.float32),
        "advantage": np.array(ADVANTAGES[sample], np.float32),
        "pg_loss": np.array(TERMS[epoch, sample], np.float32),
        "clip": np.array(CLIPS[epoch, sample], object),
    })  # fmt: skip


def critic_part(epoch: int, sample: int) -> dict:
    return part(epoch, sample, {
        "vpred": np.array([0.2, 1.0, 0.0], np.float32),
        "vpred_clipped": np.array([0.2, 0.5, 0.5], np.float32),
        "value": np.array([0.0, 0.0, 1.0], np.float32),
        "return": np.array([0.0, 1.0, 1.0], np.float32),
        "vf_loss": np.array([0.04, 0.25, 1.0], np.float32),
        "vf_clipped": np.array([False, True, False]),
    })  # fmt: skip


def hand_trace(directory, change=None, settings=SETTINGS) -> str:
    """The worked example as a trace; ``change(kind, parts)`` plants an error first."""
    batch = random_batch(1, B=2, T=3, interior=False)
    batch.mask[:] = 1
    batch.advantages = torch.tensor(ADVANTAGES)
    batch.values, batch.returns = torch.tensor([[0.0, 0.0, 1.0]] * 2), torch.tensor([[0.0, 1.0, 1.0]] * 2)
    parts = {
        "actor": [actor_part(e, s) for e in (0, 1) for s in (1, 0)],  # any order: the writer sorts
        "critic": [critic_part(e, s) for e in (0, 1) for s in (0, 1)],
    }
    if change is not None:
        change(parts)
    updates = [UpdateCapture(1, kind, parts[kind], LOGGED[kind]) for kind in ("critic", "actor")]
    return write_trace(directory, algorithm("grpo"), {1: batch}, updates={1: updates}, update_settings=settings)


UPDATE = ("update_rows", "ratio", "ratio_first", "pg_loss", "clip", "vf_loss", "update_metrics")


def update_statuses(path) -> dict[str, str]:
    return {r.identity: r.status for r in check_trace(path).identities if r.identity in UPDATE}


def test_the_worked_example_passes_every_update_identity(tmp_path):
    assert update_statuses(hand_trace(tmp_path / "t")) == {key: "pass" for key in UPDATE}


def test_the_report_lists_the_identities_in_their_order_and_sections(tmp_path, run_cli):
    report = check_trace(hand_trace(tmp_path / "t"))
    assert [r.identity for r in report.identities] == [
        "advantage_raw", "whitening", "whitening_stats", "returns", "rewards", "turn_rewards", "mask_layout", "turns", "roles", "finite",
        "steps_on_disk", *UPDATE
    ]  # fmt: skip
    code, out, _ = run_cli("check", hand_trace(tmp_path / "u"))
    assert code == 0
    sections = [line.split()[0] for line in out.splitlines() if line[:2] == "8."]
    assert sections == ["8.1", "8.2", "8.2", "8.3", "8.4", "8.4", "8.5", "8.5", "8.5", "8.5", "8.5"] + ["8.6"] * len(UPDATE)


def test_the_tables_read_back_sorted_and_joined(tmp_path):
    from verl_ext.trace.reader import open_trace

    trace = open_trace(hand_trace(tmp_path / "t"))
    actor = trace.actor_update(1).to_pydict()
    assert list(zip(actor["epoch"], actor["sample"], actor["token_index"])) == [
        (e, s, t) for e in (0, 1) for s in (0, 1) for t in range(3)
    ]
    assert actor["clip"] == [c for e in (0, 1) for s in (0, 1) for c in CLIPS[e, s]]
    assert actor["entropy"] == [None] * 12  # not reported: null
    record = trace.update_record("actor", 1)
    assert record.logged == LOGGED["actor"] and record.rows == 12
    assert [(m["epoch"], m["minibatch"]) for m in record.minibatches] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert trace.record.steps["1"].updates["critic"].rows == 12


PLANTS = {
    "ratio": lambda p: p["actor"][0]["columns"]["ratio"].__setitem__(0, 1.6),
    "pg_loss": lambda p: p["actor"][1]["columns"]["pg_loss"].__setitem__(2, -0.6),
    "clip": lambda p: p["actor"][2]["columns"]["clip"].__setitem__(0, "low"),
    "ratio_first": lambda p: [p["actor"][1]["columns"][k].__setitem__(0, v) for k, v in (("ratio", 1.1), ("log_prob", -1 + math.log(1.1)), ("pg_loss", -1.1))],
    "update_rows": lambda p: p["actor"][3]["columns"]["token_index"].__setitem__(2, 1),
    "vf_loss": lambda p: p["critic"][0]["columns"]["vf_clipped"].__setitem__(0, True),
    "update_metrics": lambda p: LOGGED["critic"].__setitem__("critic/vf_loss", 0.216),
}  # fmt: skip


@pytest.mark.parametrize("identity", PLANTS)
def test_a_planted_error_fails_its_identity(tmp_path, identity, monkeypatch):
    monkeypatch.setitem(LOGGED, "critic", dict(LOGGED["critic"]))
    statuses = update_statuses(hand_trace(tmp_path / "t", PLANTS[identity]))
    assert statuses[identity] == "fail", statuses


def test_an_update_table_whose_rows_are_not_the_run_records_fails(tmp_path):
    """The run record's ``rows`` of an update table is its row count (12 here): a record saying 11 fails."""
    path = hand_trace(tmp_path / "t")
    record_file = Path(path) / "_run.json"
    record = json.loads(record_file.read_text())
    assert record["steps"]["1"]["updates"]["critic"]["rows"] == 12
    record["steps"]["1"]["updates"]["critic"]["rows"] = 11
    record_file.write_text(json.dumps(record))
    result = check_trace(path)["update_rows"]
    assert result.status == "fail" and result.violations == 1
    assert (result.first.column, result.first.actual, result.first.expected) == ("critic rows", 12, 11)


def test_a_loss_call_without_valid_tokens_counts_in_verls_metric_means(tmp_path, monkeypatch):
    """A micro-batch whose tokens verl's rollout correction all rejected trains no row, yet verl averages
    its clip fraction (Σ/(0 + 1e-8) = 0) with the others': a second micro-batch of (epoch 0, mini-batch 1)
    without valid tokens makes that mini-batch's clip fraction (1/3 + 0)/2, the step's (0 + 1/6 + 1/3 + 1/3)/4
    = 5/24 by hand (the dual fraction, 1/6, does not move)."""

    def empty(epoch: int, minibatch: int) -> dict:
        call = actor_part(epoch, minibatch)  # every column reported, of no row
        call["columns"] = {name: values[:0] for name, values in call["columns"].items()}
        return {**call, "microbatch": 1, "valid_tokens": 0}

    def with_empty_call(parts):
        parts["actor"].append(empty(0, 1))

    monkeypatch.setitem(LOGGED, "actor", {**LOGGED["actor"], "actor/pg_clipfrac": 5 / 24})
    path = hand_trace(tmp_path / "t", with_empty_call)
    assert open_trace(path).update_record("actor", 1).empty_microbatches == [[0, 1, 1, 0]]
    assert update_statuses(path)["update_metrics"] == "pass"
    monkeypatch.setitem(LOGGED, "actor", {**LOGGED["actor"], "actor/pg_clipfrac": 0.25})  # as if the call had not been
    assert update_statuses(hand_trace(tmp_path / "u", with_empty_call))["update_metrics"] == "fail"


def test_show_adds_the_update_of_an_epoch(tmp_path, run_cli):
    code, out, err = run_cli("show", hand_trace(tmp_path / "t"), "--sample", "1", "--epoch", "1", "--format", "csv")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].endswith("minibatch,log_prob,ratio,clip,pg_loss,vpred,vf_loss")
    assert [line.split(",")[-5:] for line in lines[1:]] == [
        ["3.5", "dual", "1.5", "0.2", "0.04"], ["3.5", "high", "-2.4", "1.0", "0.25"], ["3.5", "dual", "6.0", "0.0", "1.0"]
    ]
    code, _, err = run_cli("show", hand_trace(tmp_path / "u"), "--epoch", "7")
    assert code == 2 and "no update rows of sample 0 in epoch 7 (epochs traced: 0, 1)" in err


def test_summary_reports_clip_fractions_and_the_correlation(tmp_path):
    row = summarize(hand_trace(tmp_path / "t")).to_pylist()[0]
    assert row["clip_low"] == pytest.approx(1 / 12) and row["clip_high"] == pytest.approx(2 / 12)
    assert row["clip_dual"] == pytest.approx(2 / 12)
    # last epoch: Δlog-prob = ln 0.5 on sample 0 (A = 1, −1, 0.5), ln 3.5 on sample 1 (A = −0.5, 2, −2)
    change = np.array([math.log(0.5)] * 3 + [math.log(3.5)] * 3)
    assert row["adv_dlogp_corr"] == pytest.approx(np.corrcoef(np.array(ADVANTAGES).ravel(), change)[0, 1])


def test_the_ppo_picture_of_a_run_is_drawn_at_the_step_that_clipped_most(tmp_path):
    """Where the lr has decayed, the last step's ratios sit at 1: save_plots draws the picture at the
    step with the most clipped rows (the worked example's step 2 here; steps 1 and 3 clip nothing)
    and says which."""
    import warnings

    from verl_ext.inspect import plots

    batch = random_batch(1, B=2, T=3, interior=False)
    batch.mask[:] = 1

    def updates(step: int, clipping: bool) -> list:
        parts = {"actor": [actor_part(e, s) for e in (0, 1) for s in (0, 1)], "critic": [critic_part(e, s) for e in (0, 1) for s in (0, 1)]}
        if not clipping:
            for part_ in parts["actor"]:
                part_["columns"]["clip"] = np.array(["none"] * 3, object)
        return [UpdateCapture(step, kind, parts[kind], LOGGED[kind]) for kind in ("critic", "actor")]

    path = write_trace(tmp_path / "t", algorithm("grpo"), {1: batch, 2: batch, 3: batch},
                       updates={1: updates(1, False), 2: updates(2, True), 3: updates(3, False)}, update_settings=SETTINGS)  # fmt: skip
    clipped = sum(code != "none" for codes in CLIPS.values() for code in codes)
    assert clipped > 0 and plots.most_clipped_step(open_trace(path)) == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", plots.PlotNote)
        written = plots.save_plots(path, tmp_path / "plots")
    assert [p.name for p in written if p.name.startswith("ratio")] == ["ratio_vs_advantage_step2.png"]
    assert f"ratio_vs_advantage is drawn at step 2, the step with the most clipped update rows ({clipped} of 12)" in [str(w.message) for w in caught]
    with warnings.catch_warnings(record=True):  # step 3 has no values: its value figure is left out with a note
        written = plots.save_plots(path, tmp_path / "at3", step=3)  # a step asked for is the step drawn
    assert [p.name for p in written if p.name.startswith("ratio")] == ["ratio_vs_advantage_step3.png"]


def test_the_ppo_picture_draws_every_row_in_its_clip_colour(tmp_path):
    from verl_ext.inspect import plots

    figure = plots.ratio_vs_advantage(hand_trace(tmp_path / "t"))
    drawn = {
        collection.get_label().split(" ")[0]: np.asarray(collection.get_offsets())
        for collection in figure.axes[0].collections
        if collection.get_label().startswith(("none", "low", "high", "dual"))
    }
    expected = {}
    for (epoch, sample), codes in CLIPS.items():
        for token, code in enumerate(codes):
            expected.setdefault(code, set()).add((ADVANTAGES[sample][token], RATIOS[epoch, sample]))
    assert {code: {tuple(np.round(p, 5)) for p in points} for code, points in drawn.items()} == {
        code: {tuple(np.round(p, 5)) for p in points} for code, points in expected.items()
    }
    change = plots.logprob_change(hand_trace(tmp_path / "u"), sample=1).axes[1].lines
    np.testing.assert_allclose(change[1].get_ydata(), [math.log(3.5)] * 3, rtol=1e-6)


# --------------------------------------------------------------------------- ratio and clip against verl

# One epoch, a mini-batch per sample, old_log_prob = −1, the token table's advantages (ADVANTAGES). The
# ratios and the clip each gets under ε = 0.2, c = 3, by hand:
#   sample 0, A = [1, −1, 0.5]:    r = [1.25, 0.7, 0.9]   high, low, none   terms [−1.2, 0.8, −0.45]
#   sample 1, A = [−0.5, 2, −2]:   r = [3.5, 1.1, 0.75]   dual, none, low   terms [1.5, −2.2, 1.6]
VERL_RATIOS = [[1.25, 0.7, 0.9], [3.5, 1.1, 0.75]]
VERL_CLIPS = [["high", "low", "none"], ["dual", "none", "low"]]
VERL_TERMS = [[-1.2, 0.8, -0.45], [1.5, -2.2, 1.6]]


class _ActorConfig(dict):
    """The fields of verl's ActorConfig that compute_policy_loss_vanilla reads."""

    __getattr__ = dict.__getitem__


def verl_policy_loss(sample: int, clip_ratio: float, old_log_prob: list[float], monkeypatch) -> tuple[np.ndarray, dict]:
    """verl's own compute_policy_loss_vanilla on one sample: its per-token loss matrix (what it hands
    to agg_loss, as the update hook records it) and its metrics."""
    from verl.trainer.ppo import core_algos

    seen = {}
    aggregate = core_algos.agg_loss

    def recording_agg_loss(loss_mat, **kwargs):
        seen["loss"] = loss_mat
        return aggregate(loss_mat, **kwargs)

    monkeypatch.setattr(core_algos, "agg_loss", recording_agg_loss)
    config = _ActorConfig(clip_ratio=clip_ratio, clip_ratio_low=clip_ratio, clip_ratio_high=clip_ratio, clip_ratio_c=3.0, global_batch_info={})
    log_prob = torch.tensor([[-1 + math.log(r) for r in VERL_RATIOS[sample]]])
    _, metrics = core_algos.compute_policy_loss_vanilla(
        old_log_prob=torch.tensor([old_log_prob]), log_prob=log_prob, advantages=torch.tensor([ADVANTAGES[sample]]),
        response_mask=torch.ones(1, 3), loss_agg_mode="token-mean", config=config,
    )  # fmt: skip
    monkeypatch.setattr(core_algos, "agg_loss", aggregate)
    return seen["loss"][0].numpy(), metrics


def verl_trace(directory, monkeypatch, clip_ratio: float = 0.2, stale_old_log_prob: float | None = None) -> str:
    """A trace whose loss terms and logged metrics are verl's own, for ratios and clip codes recorded
    with the run's ε = 0.2. ``clip_ratio``: the ε verl's loss actually used; ``stale_old_log_prob``:
    an old log-prob verl's loss used for sample 1, token 1 instead of the recorded −1."""
    parts, logged = [], {}
    for sample in (0, 1):
        old = [-1.0, -1.0, -1.0]
        if sample == 1 and stale_old_log_prob is not None:
            old[1] = stale_old_log_prob
        loss, metrics = verl_policy_loss(sample, clip_ratio, old, monkeypatch)
        for name, value in {**metrics, "actor/pg_loss": float(loss.mean())}.items():
            logged[name] = logged.get(name, 0.0) + value / 2  # the mean over the two mini-batches
        ratios = np.array(VERL_RATIOS[sample], np.float32)
        parts.append(part(0, sample, {
            "log_prob": np.log(ratios) - 1, "old_log_prob": np.full(3, -1.0, np.float32), "ratio": ratios,
            "advantage": np.array(ADVANTAGES[sample], np.float32), "pg_loss": loss.astype(np.float32),
            "clip": np.array(VERL_CLIPS[sample], object),
        }))  # fmt: skip
    batch = random_batch(1, B=2, T=3, interior=False)
    batch.mask[:] = 1
    batch.advantages = torch.tensor(ADVANTAGES)
    updates = [UpdateCapture(1, "actor", parts, logged)]
    return write_trace(directory, algorithm("grpo"), {1: batch}, updates={1: updates}, update_settings=SETTINGS)


def verl_statuses(path) -> dict[str, str]:
    return {r.identity: r.status for r in check_trace(path).identities if r.identity in ("ratio", "clip", "pg_loss", "update_metrics")}


def test_verls_own_loss_terms_are_the_hand_computed_ones(monkeypatch):
    for sample in (0, 1):
        loss, metrics = verl_policy_loss(sample, 0.2, [-1.0] * 3, monkeypatch)
        np.testing.assert_allclose(loss, VERL_TERMS[sample], rtol=1e-6)
    # sample 1: one of three clipped by ε (low), one by c (dual); ppo_kl = mean of −log r
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 3) and metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 3)
    assert metrics["actor/ppo_kl"] == pytest.approx(-np.log(VERL_RATIOS[1]).mean(), rel=1e-6)


def test_ratio_and_clip_agree_with_what_verl_computed(tmp_path, monkeypatch):
    path = verl_trace(tmp_path / "t", monkeypatch)
    assert verl_statuses(path) == {"ratio": "pass", "pg_loss": "pass", "clip": "pass", "update_metrics": "pass"}
    report = check_trace(path)
    # ratio: 6 rows against the log-probs, and the 2 unclipped ones (sample 0 token 2, sample 1 token 1)
    # against verl's terms; update_metrics: pg_loss, both clip fractions and ppo_kl
    assert report["ratio"].checked == 6 + 2 and report["update_metrics"].checked == 4


def test_clip_fails_when_verl_clipped_otherwise_than_the_codes_say(tmp_path, monkeypatch):
    """verl's loss ran with ε = 0.3 while the run (and the codes) say 0.2: sample 0's token 0 (r = 1.25)
    was not clipped and token 1 (r = 0.7) was clipped at 0.7, not 0.8. The unclipped tokens agree."""
    report = check_trace(verl_trace(tmp_path / "t", monkeypatch, clip_ratio=0.3))
    assert report["clip"].status == "fail" and report["ratio"].status == "pass"
    first = report["clip"].first
    assert (first.location.sample, first.location.token_index) == (0, 0)
    assert first.actual == pytest.approx(-1.25) and first.expected == pytest.approx(-1.2)


def test_ratio_fails_when_verls_loss_used_another_ratio(tmp_path, monkeypatch):
    """verl's loss read old log-prob −1.05 for sample 1, token 1 (unclipped, A = 2, r = 1.1) where the
    row records −1: verl's term is −2·1.1·e^0.05, not −A·ratio = −2.2."""
    report = check_trace(verl_trace(tmp_path / "t", monkeypatch, stale_old_log_prob=-1.05))
    assert report["ratio"].status == "fail" and report["update_metrics"].status == "fail"
    first = report["ratio"].first
    assert (first.location.sample, first.location.token_index) == (1, 1)
    assert first.actual == pytest.approx(-2 * 1.1 * math.exp(0.05), rel=1e-6) and first.expected == pytest.approx(-2.2)


def test_a_wrong_logged_ppo_kl_fails_update_metrics(tmp_path, monkeypatch):
    """ppo_kl of the worked example: the mean over mini-batches of −log r = (0 − ln 1.5 + ln 2 − ln 3.5)/4."""
    kl = (0 - math.log(1.5) + math.log(2) - math.log(3.5)) / 4
    monkeypatch.setitem(LOGGED, "actor", {**LOGGED["actor"], "actor/ppo_kl": kl})
    assert update_statuses(hand_trace(tmp_path / "t"))["update_metrics"] == "pass"
    monkeypatch.setitem(LOGGED, "actor", {**LOGGED["actor"], "actor/ppo_kl": kl + 1e-3})
    assert update_statuses(hand_trace(tmp_path / "u"))["update_metrics"] == "fail"


#: The factor of −A where a clip applies: verl clamps the bf16 ratio to 1 ± 0.2 in bf16 (1.203125,
#: 0.80078125), and multiplies −A by c = 3 in float32.
CODE_FACTOR = {"high": float(torch.tensor(1.2).bfloat16()), "low": float(torch.tensor(0.8).bfloat16()), "dual": 3.0}


def computed_in_bf16(parts) -> None:
    """The actor's numbers as verl's loss has them under its GPU default: log-probs stored in bf16, the
    ratio exp(Δ) computed in bf16 from them, each term −A·x in float32 from that ratio (the clip codes
    of the worked example stay: bf16 moves a ratio by a few 1e-3)."""
    for p in parts["actor"]:
        columns = p["columns"]
        log_prob, old = (torch.tensor(columns[name]).bfloat16() for name in ("log_prob", "old_log_prob"))
        ratio = torch.exp(torch.clamp(log_prob - old, min=-20.0, max=20.0))
        assert ratio.dtype == torch.bfloat16
        columns["log_prob"], columns["old_log_prob"] = log_prob.float().numpy(), old.float().numpy()
        columns["ratio"] = ratio.float().numpy()
        factor = [CODE_FACTOR.get(code, r) for code, r in zip(columns["clip"], columns["ratio"])]
        columns["pg_loss"] = (-columns["advantage"] * np.array(factor, np.float32)).astype(np.float32)


BF16_ACTOR = ("ratio", "ratio_first", "pg_loss", "clip")


def test_a_bf16_loss_is_checked_with_bf16_roundings(tmp_path):
    """With the run record saying the actor's loss computed in bf16, its roundings pass and float32's
    tolerance would not; an error of a few bf16 roundings (5% of one ratio) still fails."""
    bf16 = {kind: {**settings, "dtype": "bf16"} for kind, settings in SETTINGS.items()}
    statuses = lambda path: {k: v for k, v in update_statuses(path).items() if k in BF16_ACTOR}  # noqa: E731
    assert statuses(hand_trace(tmp_path / "bf16", computed_in_bf16, bf16)) == dict.fromkeys(BF16_ACTOR, "pass")
    as_fp32 = statuses(hand_trace(tmp_path / "fp32", computed_in_bf16))
    assert as_fp32["ratio"] == as_fp32["pg_loss"] == as_fp32["clip"] == "fail"

    def planted(parts):
        computed_in_bf16(parts)
        parts["actor"][0]["columns"]["ratio"][0] *= 1.05  # epoch 0, sample 1: ratio 1.5, no clip there
    assert statuses(hand_trace(tmp_path / "planted", planted, bf16))["ratio"] == "fail"


def test_bypass_modes_reinforce_is_held_to_its_own_loss_and_a_vanilla_update_is_named(tmp_path):
    """Bypass mode with loss_type=reinforce and no weights: each term is −A·log π_θ (old = rollout). The
    worked example's terms are vanilla PPO's: they fail, named as the loss verl's workers ran instead
    (found on verl 0.9.1's legacy trainer on Ray: docs/definitions.md#off-policy-tokens)."""
    from verl_ext.rollout_correction import Correction

    bypass = Correction.from_config({"bypass_mode": True, "loss_type": "reinforce"}).settings()

    def reinforce(parts):
        for call in parts["actor"]:
            columns = call["columns"]
            columns["pg_loss"] = (-columns["advantage"] * columns["log_prob"]).astype(np.float32)

    def trace(directory, change=None) -> str:
        batch = random_batch(1, B=2, T=3, interior=False)
        batch.mask[:] = 1
        batch.advantages = torch.tensor(ADVANTAGES)
        batch.values, batch.returns = torch.tensor([[0.0, 0.0, 1.0]] * 2), torch.tensor([[0.0, 1.0, 1.0]] * 2)
        batch.old_log_prob = batch.rollout_log_prob = torch.full((2, 3), -1.0)  # bypass: old = rollout
        parts = {"actor": [actor_part(e, s) for e in (0, 1) for s in (1, 0)], "critic": [critic_part(e, s) for e in (0, 1) for s in (0, 1)]}
        if change is not None:
            change(parts)
        updates = [UpdateCapture(1, kind, parts[kind], LOGGED[kind]) for kind in ("critic", "actor")]
        return write_trace(directory, algorithm("grpo", rollout_correction=bypass), {1: batch}, updates={1: updates}, update_settings=SETTINGS)

    assert check_trace(trace(tmp_path / "reinforce", reinforce))["bypass_loss"].status == "pass"
    vanilla = check_trace(trace(tmp_path / "vanilla"))["bypass_loss"]
    assert vanilla.status == "fail" and any("every term is vanilla PPO's, not REINFORCE's" in note for note in vanilla.notes)
