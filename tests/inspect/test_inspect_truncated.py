"""Cut responses in ``compare`` and ``summary`` (docs/definitions.md#truncated-responses), on a synthetic
step written by the real TraceWriter with the flags its capture computes from EOS and the length
limit. Every expected number is a hand calculation, written beside it (γ = 0.9, λ = 0.5, γλ = 0.45):

* sample 0, cut (3 tokens, the last not EOS): r = [0, 0, 0], V = [0.4, 0.5, 0.6]
  terminal: δ = [0.05, 0.04, −0.6], A = [0.05 + 0.45·(−0.23), 0.04 + 0.45·(−0.6), −0.6] = [−0.0535, −0.23, −0.6],
  returns A + V = [0.3465, 0.27, 0]; bootstrap with V(s_L) = 0.8: δ_2 = 0.9·0.8 − 0.6 = 0.12,
  A = [0.05 + 0.45·0.094, 0.04 + 0.45·0.12, 0.12] = [0.0923, 0.094, 0.12], returns [0.4923, 0.594, 0.72];
* sample 1, EOS at length 2: r = [0, 1], V = [0.5, 0.7]: δ = [0.13, 0.3], A = [0.265, 0.3];
* sample 2, EOS at the limit (not cut): r = [0, 0, 1], V = [0.3, 0.4, 0.6]: δ = [0.06, 0.14, 0.4],
  A = [0.204, 0.32, 0.4].
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.inspect.inspect_helpers import algorithm
from verl_ext import registry
from verl_ext.inspect import compare, summarize
from verl_ext.steps.as_run import as_run
from verl_ext.steps.cuts import StepCuts
from verl_ext.steps.layout import StepData, StepLayout
from verl_ext.steps.recorded import RecordedAlgorithm

GAMMA, LAM, EOS, LIMIT = 0.9, 0.5, 3, 3
MASK = [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
REWARDS = [[0, 0, 0], [0, 1, 0], [0, 0, 1]]
VALUES = [[0.4, 0.5, 0.6], [0.5, 0.7, 0], [0.3, 0.4, 0.6]]
TOKENS = [[7, 8, 9], [7, EOS, 0], [7, 8, EOS]]
# by hand (module docstring), at the valid tokens in order
TERMINAL = [-0.0535, -0.23, -0.6, 0.265, 0.3, 0.204, 0.32, 0.4]
TERMINAL_RETURNS_CUT = [0.3465, 0.27, 0.0]
BOOTSTRAP_CUT, BOOTSTRAP_RETURNS_CUT = [0.0923, 0.094, 0.12], [0.4923, 0.594, 0.72]
CUT = np.array([True] * 3 + [False] * 5)
#: the trace stores rewards and values as float32 (0.4 is 0.4000000059604645 there)
TOL = 1e-6


def write(directory, advantages=None, flags: bool = True, bootstrap: bool = False, uncut_step: int | None = None, **settings) -> str:
    """The step above (step 1) with ``advantages`` as the recorded trained-on advantage; ``bootstrap``: a
    run with algorithm.truncation=bootstrap, which records V(s_L) = 0.8 for the cut response;
    ``uncut_step``: also that step, the same but sample 0 ending on EOS (no response cut)."""
    from verl_ext.truncation import Truncation

    from verl_ext.options import TraceOptions
    from verl_ext.trace.capture import StepCapture
    from verl_ext.trace.schema import RunRecord
    from verl_ext.trace.writer import TraceWriter

    mask, rewards = torch.tensor(MASK, dtype=torch.float32), torch.tensor(REWARDS, dtype=torch.float32)
    adv = torch.zeros(3, 3) if advantages is None else torch.tensor(advantages, dtype=torch.float32)
    options = TraceOptions(dir=str(directory))
    settings = {**settings, "truncation": "bootstrap"} if bootstrap else settings
    record = RunRecord(
        verl_ext_version="test", verl_version="0.9.1", trainer="legacy", created_at="2026-01-01T00:00:00+00:00",
        algorithm=algorithm("gae_ext", gamma=GAMMA, lam=LAM, **settings), model_path="", tokenizer_path="",
        rollout_n=1, trace=options.as_dict(),
    )  # fmt: skip
    ends = dict(eos_token_ids=[EOS], max_response_length=LIMIT) if flags else {}
    if bootstrap:
        ends["truncation"] = Truncation("bootstrap", torch.tensor([True, False, False]), torch.tensor([0.8, 0.0, 0.0]))
    with TraceWriter(options, record) as writer:
        writer.submit(StepCapture(
            step=1, mask=mask, token_id=torch.tensor(TOKENS), uid=["a", "a", "b"],
            floats={"score": rewards, "reward": rewards, "value": torch.tensor(VALUES), "advantage": adv, "advantage_raw": adv},
            prompts=torch.ones(3, 2, dtype=torch.long), **ends,
            whitening=registry.whitening_statistics(adv, mask, ends.get("truncation")),
        ))  # fmt: skip
        if uncut_step is not None:
            ended = torch.tensor(TOKENS)
            ended[0, -1] = EOS
            writer.submit(StepCapture(
                step=uncut_step, mask=mask, token_id=ended, uid=["a", "a", "b"],
                floats={"score": rewards, "reward": rewards, "value": torch.tensor(VALUES), "advantage": adv, "advantage_raw": adv},
                prompts=torch.ones(3, 2, dtype=torch.long), **{key: value for key, value in ends.items() if key != "truncation"},
                whitening=registry.whitening_statistics(adv, mask),
            ))  # fmt: skip
    return str(directory)


# ------------------------------------------------------------------ the treatments themselves


def step_data(directory) -> tuple[StepData, RecordedAlgorithm]:
    from verl_ext.trace.reader import open_trace

    trace = open_trace(write(directory))
    return StepData.read(trace, 1, ("reward", "value")), RecordedAlgorithm.from_record(trace.record)


def test_each_treatment_against_the_hand_calculation(tmp_path):
    """bootstrap from a prompt table that holds V(s_L) (the recorded ``bootstrap_value``, 0.8 for the cut
    response, null elsewhere), terminal and mask from the trace's own flags; the whitening as the run's
    (gae_ext whitens): over every valid token, under mask over the responses not cut, 0 on the cut one."""
    data, run = step_data(tmp_path / "t")
    prompts = pa.table({"sample": pa.array([0, 1, 2], pa.int32()), "truncated": [True, False, False],
                        "bootstrap_value": pa.array([0.8, None, None], pa.float32())})  # fmt: skip
    cuts = StepCuts.of(prompts, data.layout)
    assert cuts.cut.tolist() == [True, False, False] and cuts.why_not("bootstrap") is None
    terminal = as_run(data, run, cuts, mode="terminal")
    np.testing.assert_allclose(terminal.advantage_raw, TERMINAL, atol=TOL)
    np.testing.assert_allclose(terminal.returns[CUT], TERMINAL_RETURNS_CUT, atol=TOL)
    np.testing.assert_allclose(terminal.advantages, whiten(np.array(TERMINAL)), atol=TOL)
    assert terminal.whitening.mean == pytest.approx(np.mean(TERMINAL), abs=TOL) and terminal.notes == ()
    # a masking run whose step does not say which responses were cut: every response ended, said in a note
    without_cuts = as_run(data, dataclasses.replace(run, truncation="mask"), None)
    np.testing.assert_allclose(without_cuts.before_whitening, TERMINAL, atol=TOL)
    assert without_cuts.mode == "terminal" and without_cuts.notes[0].startswith("re-estimated as terminal:")
    bootstrap = as_run(data, run, cuts, mode="bootstrap")
    np.testing.assert_allclose(bootstrap.before_whitening[CUT], BOOTSTRAP_CUT, atol=TOL)
    np.testing.assert_allclose(bootstrap.returns[CUT], BOOTSTRAP_RETURNS_CUT, atol=TOL)
    np.testing.assert_allclose(bootstrap.before_whitening[~CUT], TERMINAL[3:], atol=TOL)  # only the cut response moves
    masked = as_run(data, run, cuts, mode="mask")
    np.testing.assert_allclose(masked.advantage_raw, TERMINAL, atol=TOL)  # the estimator's output is terminal's
    np.testing.assert_allclose(masked.before_whitening, [0, 0, 0, *TERMINAL[3:]], atol=TOL)
    np.testing.assert_allclose(masked.returns[CUT], TERMINAL_RETURNS_CUT, atol=TOL)  # the critic's target is terminal's
    np.testing.assert_allclose(masked.advantages, [0, 0, 0, *whiten(np.array(TERMINAL[3:]))], atol=TOL)
    assert masked.whitening.tokens.tolist() == (~CUT).tolist()


def test_a_trace_without_the_recorded_value_cannot_bootstrap(tmp_path):
    data, run = step_data(tmp_path / "t")
    cuts = StepCuts.of(pa.table({"sample": pa.array([0, 1, 2], pa.int32()), "truncated": [True, False, False]}), data.layout)
    assert "bootstrap_value" in cuts.why_not("bootstrap") and cuts.why_not("mask") is None
    with pytest.raises(ValueError, match="truncation=bootstrap cannot be recomputed"):
        as_run(data, run, cuts, mode="bootstrap")
    # the run's own treatment falls back to terminal, and says why
    fallback = as_run(data, dataclasses.replace(run, truncation="bootstrap"), cuts)
    np.testing.assert_allclose(fallback.before_whitening, TERMINAL, atol=TOL)
    assert "bootstrap_value" in fallback.notes[0]
    no_flags = StepCuts.of(pa.table({"sample": pa.array([0, 1, 2], pa.int32()), "truncated": pa.nulls(3, pa.bool_())}), data.layout)
    assert not no_flags.recorded and "no truncated flags" in no_flags.why_not("mask")


# ------------------------------------------------------------------ compare


def whiten(x: np.ndarray) -> np.ndarray:
    """verl's masked_whiten over a fully valid vector: (x − μ)/sqrt(σ² + 1e-8), σ² with n − 1."""
    return (x - x.mean()) / np.sqrt(x.var(ddof=1) + 1e-8)


def test_compare_shows_the_treatments_side_by_side(tmp_path):
    result = compare(write(tmp_path / "t"), step=1, sample=0)
    assert result.truncation == "terminal" and result.cut == (0,)
    rows = {row["treatment"]: row for row in result.treatments.to_pylist()}
    assert list(rows) == ["terminal", "mask"]  # bootstrap: no V(s_L) in this trace, and a note says why
    assert any(note.startswith("truncation=bootstrap is not compared") and "bootstrap_value" in note for note in result.notes)
    terminal, masked = rows["terminal"], rows["mask"]
    assert terminal["cut_mean_return"] == pytest.approx((0.3465 + 0.27 + 0) / 3, abs=TOL)
    assert terminal["cut_mean_adv"] == pytest.approx(-0.8835 / 3, abs=TOL)
    # Σ|A| = 0.8835 (cut) + 0.565 + 0.924
    assert terminal["cut_share_abs"] == pytest.approx(0.8835 / 2.3725, abs=TOL)
    white = whiten(np.array(TERMINAL))
    assert terminal["cut_adv_whitened"] == pytest.approx(white[CUT].mean(), abs=TOL)
    assert terminal["rest_adv_whitened"] == pytest.approx(white[~CUT].mean(), abs=TOL)
    assert masked["cut_mean_return"] == pytest.approx(terminal["cut_mean_return"], abs=1e-12)
    assert masked["cut_mean_adv"] == 0 and masked["cut_share_abs"] == 0 and masked["cut_adv_whitened"] == 0
    # whitened over exactly the uncut tokens: their mean is 0
    assert masked["rest_adv_whitened"] == pytest.approx(0.0, abs=TOL)
    by_token = result.by_treatment.to_pydict()
    assert by_token["token_index"] == [0, 1, 2]
    np.testing.assert_allclose(by_token["terminal"], TERMINAL[:3], atol=TOL)
    assert by_token["mask"] == [0.0, 0.0, 0.0]


def test_compare_under_a_chosen_treatment_and_the_recorded_one(tmp_path, run_cli):
    path = write(tmp_path / "t")
    masked = compare(path, step=1, truncation="mask").table.to_pydict()
    assert masked["gae0.5"] == [0.0, 0.0, 0.0]  # sample 0 is the cut one
    assert compare(path, step=1, sample=1, truncation="mask").table.to_pydict()["gae0.5"] == pytest.approx(TERMINAL[3:5], abs=TOL)
    recorded_mask = write(tmp_path / "m", truncation="mask")
    assert compare(recorded_mask, step=1).truncation == "mask"  # by default, as the run did
    code, out, err = run_cli("compare", path, "--step", "1", "--truncation", "bootstrap")
    assert code == 2 and "truncation=bootstrap" in err and "bootstrap_value" in err and err.count("\n") == 1
    code, out, _ = run_cli("compare", path, "--step", "1", "--truncation", "mask")
    assert code == 0 and "cut responses treated as truncation=mask" in out
    assert "responses cut at the length limit: 1 (sample 0;" in out and "sample 0 (cut): advantages before whitening under each truncation" in out


def test_compare_on_a_bootstrap_run_shows_all_three(tmp_path, run_cli):
    path = write(tmp_path / "b", bootstrap=True)
    result = compare(path, step=1, sample=0)
    assert result.truncation == "bootstrap"  # as the run did
    np.testing.assert_allclose(result.table.to_pydict()["gae0.5"], BOOTSTRAP_CUT, atol=TOL)
    rows = {row["treatment"]: row for row in result.treatments.to_pylist()}
    assert list(rows) == ["terminal", "bootstrap", "mask"]
    assert rows["bootstrap"]["cut_mean_return"] == pytest.approx(sum(BOOTSTRAP_RETURNS_CUT) / 3, abs=TOL)
    assert rows["bootstrap"]["cut_mean_adv"] == pytest.approx(sum(BOOTSTRAP_CUT) / 3, abs=TOL)
    assert rows["bootstrap"]["cut_share_abs"] == pytest.approx(0.3063 / (0.3063 + 0.565 + 0.924), abs=TOL)
    white = whiten(np.array([*BOOTSTRAP_CUT, *TERMINAL[3:]]))
    assert rows["bootstrap"]["cut_adv_whitened"] == pytest.approx(white[CUT].mean(), abs=TOL)
    assert rows["terminal"]["cut_mean_adv"] == pytest.approx(-0.8835 / 3, abs=TOL)
    by_token = result.by_treatment.to_pydict()
    np.testing.assert_allclose(by_token["bootstrap"], BOOTSTRAP_CUT, atol=TOL)
    np.testing.assert_allclose(by_token["terminal"], TERMINAL[:3], atol=TOL)
    assert not any("is not compared" in note for note in result.notes)
    code, out, _ = run_cli("compare", path, "--step", "1", "--truncation", "terminal")
    assert code == 0 and "treated as" not in out and "responses cut at the length limit: 1 (sample 0;" in out


def test_compare_takes_the_last_step_and_with_truncation_the_last_one_with_a_cut(tmp_path, run_cli, capsys):
    """Step 1 has a cut response (sample 0), step 2 none: without --step compare re-estimates step 2; a bare
    --truncation (the run's own treatment, terminal, against the others) picks step 1, as does --truncation MODE."""
    path = write(tmp_path / "t", uncut_step=2)
    code, out, err = run_cli("compare", path)
    assert (code, err) == (0, "") and out.startswith("step 2, sample 0: raw advantages") and "responses cut" not in out
    code, out, err = run_cli("compare", path, "--truncation")
    assert (code, err) == (0, "") and out.startswith("step 1, sample 0: raw advantages (before whitening) by estimator\n")
    assert "responses cut at the length limit: 1 (sample 0; docs/definitions.md#truncated-responses)" in out
    code, out, _ = run_cli("compare", path, "--truncation", "mask")
    assert code == 0 and out.startswith("step 1, sample 0: raw advantages (before whitening) by estimator, cut responses treated as truncation=mask")
    code, out, _ = run_cli("compare", path, "--truncation", "--step", "2")
    assert code == 0 and out.startswith("step 2, sample 0:")

    none = write(tmp_path / "none", uncut_step=2, flags=False)
    code, out, err = run_cli("compare", none, "--truncation")
    assert code == 0 and out.startswith("step 2, sample 0:")
    assert err == f"note: no step of {none} has a response cut at the length limit (or the trace records no truncated flags): comparing the last step\n"
    with pytest.raises(SystemExit) as exit_info:
        run_cli("compare", path, "--truncation", "drop")
    assert exit_info.value.code == 2 and "invalid choice: 'drop' (choose from terminal, bootstrap, mask)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run_cli("compare", "--help")
    help_text = " ".join(capsys.readouterr().out.split())
    assert "the traced step to re-estimate (default: the last traced step" in help_text
    assert "on the last step with cut responses unless --step" in help_text and "a bare --truncation: as the run did" in help_text


def test_compare_without_flags_says_so_and_shows_no_treatments(tmp_path):
    result = compare(write(tmp_path / "t", flags=False), step=1)
    assert result.treatments is None and result.by_treatment is None
    assert any(note.startswith("truncated responses are not compared: the trace records no truncated flags") for note in result.notes)


# ------------------------------------------------------------------ summary


def test_summary_share_and_mean_advantage_of_the_cut_responses(tmp_path):
    trained = [[-1.0, -2.0, -3.0], [0.5, 1.5, 9.0], [0.0, 1.0, 2.0]]  # 9.0 sits on a masked position: never read
    row = summarize(write(tmp_path / "t", advantages=trained)).to_pylist()[0]
    assert row["truncated_share"] == pytest.approx(1 / 3)
    assert row["adv_truncated"] == pytest.approx(-2.0)  # (−1 − 2 − 3)/3
    assert row["adv_rest"] == pytest.approx(1.0)  # (0.5 + 1.5 + 0 + 1 + 2)/5


def test_summary_without_flags_is_blank_with_a_note(tmp_path, run_cli):
    path = write(tmp_path / "t", flags=False)
    row = summarize(path).to_pylist()[0]
    assert row["truncated_share"] is None and row["adv_truncated"] is None and row["adv_rest"] is None
    code, out, err = run_cli("summary", path)
    assert code == 0 and "truncated_share" not in out.splitlines()[0]
    assert err.startswith("note: truncated_share, adv_truncated and adv_rest are blank at step 1: the trace records no truncated flags")
    assert "docs/definitions.md#truncated-responses" in err and err.count("\n") == 1
