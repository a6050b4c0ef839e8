import pytest
import torch
from tests.inspect.inspect_helpers import Batch, algorithm, by_definition, write_trace

from verl_ext.inspect.summary import summarize


#: What ``summary`` says on a trace without ``truncated`` flags (as these synthetic ones are).
NO_FLAGS_NOTE = (
    "note: truncated_share, adv_truncated and adv_rest are blank at {steps}: the trace records no truncated flags "
    "(a trace of format 1, or of a run whose EOS tokens or max_response_length it did not know; "
    "docs/definitions.md#truncated-responses)\n"
)


def small_trace(directory) -> str:
    """Two samples, MC returns (γ = 1), no whitening, no KL:
    sample 0: scores [0, 0, 1],      values [0.2, 0.4, 0.6]      -> returns [1, 1, 1]
    sample 1: scores [0, ·, 0.5, ·], values [0.1, ·, 0.3, ·]     -> returns [0.5, ·, 0.5]  (· masked)"""
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 1, 0]])
    scores = torch.tensor([[0.0, 0, 1, 0], [0, 0, 0.5, 0]])
    values = torch.tensor([[0.2, 0.4, 0.6, 0], [0.1, 7, 0.3, 7]])
    ids, prompt = torch.ones(2, 4, dtype=torch.long), torch.ones(2, 1, dtype=torch.long)
    b = Batch(mask, ids, prompt, torch.ones(2, 1) > 0, scores, None, scores.clone(), values)
    b = by_definition(b, "mc", gamma=1.0, whitened=False)
    return write_trace(directory, algorithm("mc", whiten_advantages=False), {3: b})


def test_summary_numbers_by_hand(tmp_path):
    row = summarize(small_trace(tmp_path / "t")).to_pylist()[0]
    # raw advantages R − V = [0.8, 0.6, 0.4, 0.4, 0.2]: mean 0.48, Σ(x − x̄)² = 0.208
    # Var(R) = Σ([.2, .2, .2, −.3, −.3]²)/4 = 0.075, Var(R − V) = 0.208/4 = 0.052
    expected = {
        "step": 3, "samples": 2, "tokens": 5, "score": 0.75, "reward": 0.75, "kl": None, "value": 0.32,
        "return": 0.8, "adv_raw_mean": 0.48, "adv_raw_std": (0.208 / 4) ** 0.5, "adv_mean": 0.48,
        "adv_std": (0.208 / 4) ** 0.5, "explained_var": 1 - 0.052 / 0.075,
        "clip_low": None, "clip_high": None, "clip_dual": None, "adv_dlogp_corr": None,  # no update tables
        # an mc run: G is the recorded return, but ev_mc's 5 tokens (explained_var above) and ev_mc_last's 2
        # (G = [1, 0.5], G − V = [0.4, 0.2]: 1 − 0.02/0.125) are fewer than the 8 a bucket's EV needs
        "ev_mc": None, "ev_mc_last": None,
        # sample 1's hole makes two turns of it: 1.5 turns a sample; its last token (|A| = 0.2) is after the hole
        "turns": 1.5, "adv_share_after_hole": 0.2 / 2.4,
        "tool_calls": None,  # no agent loop said how many
        "truncated_share": None, "adv_truncated": None, "adv_rest": None,  # the trace records no truncated flags
        # no rollout log-probs, weights or rejection: tests/inspect/test_check_correction.py has them
        "lp_gap_p50": None, "lp_gap_p99": None, "lp_gap_max": None, "offpolicy_kl": None, "is_mean": None, "is_ess": None,
        "is_truncated": None, "rejected_tokens": None, "rejected_responses": None,
    }  # fmt: skip
    assert row == pytest.approx(expected, abs=1e-6)


def test_summary_command(tmp_path, run_cli):
    path = small_trace(tmp_path / "t")
    code, out, err = run_cli("summary", path)
    assert code == 0 and err == NO_FLAGS_NOTE.format(steps="step 3")
    run, table = out.split("\n\n")
    assert run == "rollout:  not recorded (the run record does not say)\nfinished: unknown (the run record does not say)"
    header, line = table.splitlines()
    assert header.split() == [
        "step",
        "samples",
        "tokens",
        "score",
        "reward",
        "value",
        "return",
        "adv_raw_mean",
        "adv_raw_std",
        "adv_mean",
        "adv_std",
        "explained_var",
        "turns",
        "adv_share_after_hole",
    ]  # fmt: skip  (kl: none)
    assert line.split()[:4] == ["3", "2", "5", "0.7500"]
    assert line.split()[-3:] == ["0.3067", "1.5000", "0.0833"]  # ev_mc, ev_mc_last: blank on every step, left out
    code, out, _ = run_cli("summary", path, "--format", "csv")
    assert out.splitlines()[0].startswith("step,samples,tokens,score,reward,kl,")


def test_a_single_turn_step_has_no_turn_statistics(tmp_path):
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])  # padding only: no hole
    scores = torch.tensor([[0.0, 0, 1, 0], [0, 0.5, 0, 0]])
    ids, prompt = torch.ones(2, 4, dtype=torch.long), torch.ones(2, 1, dtype=torch.long)
    b = by_definition(Batch(mask, ids, prompt, torch.ones(2, 1) > 0, scores, None, scores.clone(), scores + 0.1), "mc", gamma=1.0)
    row = summarize(write_trace(tmp_path / "t", algorithm("mc"), {1: b})).to_pylist()[0]
    assert row["turns"] is None and row["adv_share_after_hole"] is None and row["tokens"] == 5


def test_tool_calls_are_the_mean_over_the_responses_whose_agent_loop_said(tmp_path):
    """tests/view/test_view_turns.py's step: records of 1, 0 and 1 tool calls, and one response without a record."""
    from tests.view.test_view_turns import write_multi_turn_trace

    row = summarize(write_multi_turn_trace(tmp_path / "t", "no-tokenizer")).to_pylist()[0]
    assert row["tool_calls"] == pytest.approx(2 / 3)



def test_summary_says_why_adv_dlogp_corr_is_blank(tmp_path, run_cli):
    """The worked update of tests/inspect/test_inspect_update.py (two epochs of two mini-batches)
    with log_prob = old_log_prob on every row, as on the first step of a warm-up from a learning
    rate of 0: Δlog-prob does not vary, the correlation is undefined, and the summary says why."""
    from tests.inspect.test_inspect_update import hand_trace

    def unmoved(parts):
        for actor in parts["actor"]:
            actor["columns"]["log_prob"] = actor["columns"]["old_log_prob"].copy()

    path = hand_trace(tmp_path / "t", unmoved)
    assert summarize(path).column("adv_dlogp_corr").to_pylist() == [None]
    code, out, err = run_cli("summary", path)
    assert code == 0 and out
    assert err == (
        "note: adv_dlogp_corr is blank at step 1: log_prob = old_log_prob on every row of its last epoch: the update "
        "computed every log-prob before the policy moved (a learning rate of 0, e.g. on the first step of verl's "
        "warm-up: actor.optim.lr_warmup_steps starts it at 0)\n" + NO_FLAGS_NOTE.format(steps="step 1")
    )
    code, _, err = run_cli("summary", hand_trace(tmp_path / "moved"))  # the policy moved: a correlation, no note on it
    assert code == 0 and err == NO_FLAGS_NOTE.format(steps="step 1")


def test_a_single_mini_batch_of_one_epoch_is_named_as_the_reason(tmp_path):
    """One mini-batch in one epoch: every log-prob is computed before the only optimizer step."""
    from tests.inspect.test_inspect_update import hand_trace
    from verl_ext.check.update_checks import why_no_correlation
    from verl_ext.trace.reader import open_trace

    def one_minibatch_unmoved(parts):
        parts["actor"] = [actor for actor in parts["actor"] if actor["epoch"] == 0]
        for actor in parts["actor"]:
            actor["minibatch"] = 0
            actor["columns"]["log_prob"] = actor["columns"]["old_log_prob"].copy()

    trace = open_trace(hand_trace(tmp_path / "t", one_minibatch_unmoved))
    assert why_no_correlation(trace, 1).endswith("(one mini-batch in one epoch: its only optimizer step comes after them)")
