"""The report texts a notebook gets from ``verl_ext.inspect`` and the CLI prints: ``comparison_report``
(``verl-ext compare``) and ``critic_report`` (``verl-ext summary --critic``), against texts written
here by hand: the numbers of a two-response trace worked out below, and small tables made up here."""

from __future__ import annotations

import pyarrow as pa
import pytest
from tests.inspect.test_critic_diagnostics import hand_trace

import verl_ext.inspect as vi
from verl_ext.inspect.comparison import Comparison
from verl_ext.inspect.critic import CRITIC_SCHEMA

# The hand trace (tests/inspect/test_critic_diagnostics.py), γ = 0.5, an mc run, step 7:
#   response 0: rewards [0, 0, 1],   values [0.2, 0.4, 0.6]  ->  G = [0.25, 0.5, 1]
#   response 1: rewards [0, ·, 0.5], values [0.1, ·, 0.3]    ->  G = [0.25, ·, 0.5]  (a hole: two turns)
# Compared at n = 1 and λ = 1 (gae1 = mc, nstep1 = td0), on the 5 valid tokens (response 0, then 1):
#   mc       = G − V                        = [0.05, 0.1, 0.4 | 0.15, 0.2]
#   td0      = r_t + γ V_{t+1} − V_t        = [0, −0.1, 0.4 | 0.05, 0.2]
#   turn_gae = per turn, R_k + γ V_{k+1} − V_k summed back (λ = 1): response 0 one turn, 1 + 0 − 0.2 = 0.8;
#              response 1: δ = [0 + 0.5·0.3 − 0.1, 0.5 − 0.3] = [0.05, 0.2], A = [0.05 + 0.5·0.2, 0.2]
#                                            = [0.8, 0.8, 0.8 | 0.15, 0.2]
# var_batch (n − 1): mc 0.073/4 = 0.01825, td0 0.152/4 = 0.038, turn_gae 0.47/4 = 0.1175;
# mean |A|: 0.9/5 = 0.18, 0.75/5 = 0.15, 2.75/5 = 0.55; one response per prompt: no var_within_group.
# Σ|A| by position (response 1's tokens at 0 and 2): mc [0.2, 0.1, 0.6]/0.9, td0 [0.05, 0.1, 0.6]/0.75,
# turn_gae [0.95, 0.8, 1.0]/2.75. Correlations: mc·td0 0.0985/√(0.073·0.152) = 0.935,
# mc·turn_gae 0.0075/√(0.073·0.47) = 0.040, td0·turn_gae −0.015/√(0.152·0.47) = −0.056.
HAND_COMPARISON = """\
step 7, sample 0: raw advantages (before whitening) by estimator

| token_index | token | reward | value | mc | td0 | nstep1 | gae1 | turn_gae |
|---:|:---|---:|---:|---:|---:|---:|---:|---:|
| 0 | #1 | 0.00 | 0.20 | 0.05 | 0.00 | 0.00 | 0.05 | 0.80 |
| 1 | #1 | 0.00 | 0.40 | 0.10 | -0.10 | -0.10 | 0.10 | 0.80 |
| 2 | #1 | 1.00 | 0.60 | 0.40 | 0.40 | 0.40 | 0.40 | 0.80 |

per estimator, over the step's valid tokens:

| estimator | var_batch | mean_abs |
|:---|---:|---:|
| mc | 0.02 | 0.18 |
| td0 | 0.04 | 0.15 |
| nstep1 | 0.04 | 0.15 |
| gae1 | 0.02 | 0.18 |
| turn_gae | 0.12 | 0.55 |

share of the step's Σ|A| per position:

| token_index | mc | td0 | nstep1 | gae1 | turn_gae |
|---:|---:|---:|---:|---:|---:|
| 0 | 0.22 | 0.07 | 0.07 | 0.22 | 0.35 |
| 1 | 0.11 | 0.13 | 0.13 | 0.11 | 0.29 |
| 2 | 0.67 | 0.80 | 0.80 | 0.67 | 0.36 |

correlation between estimators:

| estimator | mc | td0 | nstep1 | gae1 | turn_gae |
|:---|---:|---:|---:|---:|---:|
| mc | 1.00 | 0.94 | 0.94 | 1.00 | 0.04 |
| td0 | 0.94 | 1.00 | 1.00 | 0.94 | -0.06 |
| nstep1 | 0.94 | 1.00 | 1.00 | 0.94 | -0.06 |
| gae1 | 1.00 | 0.94 | 0.94 | 1.00 | 0.04 |
| turn_gae | 0.04 | -0.06 | -0.06 | 0.04 | 1.00 |

note: no prompt has two responses at this step: var_within_group is empty

note: truncated responses are not compared: the trace records no truncated flags (docs/definitions.md#truncated-responses)"""

# The critic on the same step: deciles ⌊10·i/L⌋ of response 0 (L = 3) d0, d3, d6 and of response 1
# (L = 2) d0, d5; |V − G| = [0.05, 0.1, 0.4 | 0.15, 0.2]: d0 (0.05 + 0.15)/2 = 0.1, d3 0.1, d5 0.2,
# d6 0.4, last (0.4 + 0.2)/2 = 0.3, all 0.9/5 = 0.18; turn0 = both first tokens 0.1, turn1 =
# after_hole = response 1's last 0.2. No bucket reaches 8 tokens: every EV is blank (its column
# dropped), and 9 cells hold 1 … 7 tokens (d0, d3, d5, d6, last, all, turn0, turn1, after_hole).
HAND_CRITIC = """\
explained variance 1 − Var(G − V)/Var(G) of the values V against the Monte-Carlo return G (γ = 0.5),
by position: d0 … d9 the deciles of each response's valid tokens, last its last valid token, all every one:

| step |
|---:|
| 7 |

note: EV is blank where a bucket holds fewer than 8 tokens (9 step × bucket cells here): on a handful of returns it swings far below −1 and says nothing (docs/definitions.md §9)

tokens by position:

| step | d0 | d1 | d2 | d3 | d4 | d5 | d6 | d7 | d8 | d9 | last | all | turn0 | turn1 | after_hole |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| 7 | 2 | 0 | 0 | 1 | 0 | 1 | 1 | 0 | 0 | 0 | 2 | 5 | 2 | 1 | 1 |

mean |V − G| by position:

| step | d0 | d3 | d5 | d6 | last | all | turn0 | turn1 | after_hole |
|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
| 7 | 0.10 | 0.10 | 0.20 | 0.40 | 0.30 | 0.18 | 0.10 | 0.20 | 0.20 |"""


@pytest.fixture(scope="module")
def hand(tmp_path_factory) -> str:
    return hand_trace(tmp_path_factory.mktemp("reports") / "t")


def test_the_comparison_report_of_the_hand_trace(hand, run_cli):
    comparison = vi.compare(hand, step=7, sample=0, n=1, lambdas=(1.0,))
    assert vi.comparison_report(comparison, "markdown", 2) == HAND_COMPARISON
    code, out, _ = run_cli("compare", hand, "--step", "7", "--n", "1", "--lambdas", "1", "--format", "markdown", "--digits", "2")
    assert (code, out) == (0, HAND_COMPARISON + "\n")  # the command prints the report, nothing else


def test_the_critic_report_of_the_hand_trace(hand, run_cli):
    assert vi.critic_report(vi.critic_diagnostics(hand), 0.5, "markdown", 2) == HAND_CRITIC
    code, out, _ = run_cli("summary", hand, "--critic", "--format", "markdown", "--digits", "2", "-q")
    assert code == 0 and out.endswith("\n\n" + HAND_CRITIC + "\n")  # below the run's header
    assert out.startswith("- rollout:  ")


def made_up_comparison() -> Comparison:
    """One estimator on two tokens of sample 1, a step whose samples 0 and 2 were cut, compared
    under truncation=mask: every table small enough to lay out by hand."""
    f64 = pa.float64()
    return Comparison(
        step=3,
        sample=1,
        labels=("mc",),
        table=pa.table({
            "token_index": pa.array([0, 1], pa.int32()), "token": ["a", "b"], "reward": [0.0, 1.0],
            "value": [0.5, 0.25], "mc": [0.2, 1.0],
        }),  # fmt: skip
        statistics=pa.table({"estimator": ["mc"], "var_batch": [0.32], "var_within_group": pa.array([None], f64), "mean_abs": [0.6]}),
        shares=pa.table({"token_index": pa.array([0, 1], pa.int32()), "mc": [0.2 / 1.2, 1.0 / 1.2]}),
        correlation=pa.table({"estimator": ["mc"], "mc": [1.0]}),
        notes=("a note",),
        truncation="mask",
        treatments=pa.table({"treatment": ["terminal", "mask"], "cut_mean_return": [1.0, 0.5], "cut_mean_adv": [0.25, 0.0]}),
        by_treatment=pa.table({"token_index": pa.array([0, 1], pa.int32()), "token": ["a", "b"], "terminal": [0.2, 1.0], "mask": [0.0, 0.0]}),
        cut=(0, 2),
    )


def test_the_comparison_report_lays_out_the_treatments_and_the_notes():
    """Text: numbers right-aligned, names left-aligned, two spaces between columns; a column null
    everywhere (var_within_group) left out; the correlations to 2 decimals whatever ``digits``."""
    expected = "\n\n".join([
        "step 3, sample 1: raw advantages (before whitening) by estimator, cut responses treated as truncation=mask",
        "token_index  token  reward  value     mc\n"
        "          0  a       0.000  0.500  0.200\n"
        "          1  b       1.000  0.250  1.000",
        "per estimator, over the step's valid tokens:",
        "estimator  var_batch  mean_abs\n"
        "mc             0.320     0.600",
        "share of the step's Σ|A| per position:",
        "token_index     mc\n"
        "          0  0.167\n"
        "          1  0.833",
        "correlation between estimators:",
        "estimator    mc\n"
        "mc         1.00",
        "responses cut at the length limit: 2 (samples 0, 2; docs/definitions.md#truncated-responses); the run's "
        "estimator under each truncation, over the step's valid tokens (adv: before whitening, 0 under mask):",
        "treatment  cut_mean_return  cut_mean_adv\n"
        "terminal             1.000         0.250\n"
        "mask                 0.500         0.000",
        "sample 1 (not cut): advantages before whitening under each truncation",
        "token_index  token  terminal   mask\n"
        "          0  a         0.200  0.000\n"
        "          1  b         1.000  0.000",
        "note: a note",
    ])  # fmt: skip
    assert vi.comparison_report(made_up_comparison(), "text", 3) == expected
    # CSV: the per-token table alone, without reward and value, each float as Python writes it
    assert vi.comparison_report(made_up_comparison(), "csv") == "token_index,token,mc\n0,a,0.2\n1,b,1.0"


def test_the_critic_report_of_buckets_with_enough_tokens_has_no_note():
    diagnostics = pa.Table.from_pylist(
        [
            {"step": 1, "bucket": "all", "tokens": 10, "explained_var": 0.25, "mean_abs_error": 0.3, "mean_return": 0.5, "mean_value": 0.2},
            {"step": 2, "bucket": "all", "tokens": 12, "explained_var": -1.5, "mean_abs_error": 0.7, "mean_return": 0.5, "mean_value": 0.2},
        ],
        schema=CRITIC_SCHEMA,
    )
    expected = "\n\n".join([
        "explained variance 1 − Var(G − V)/Var(G) of the values V against the Monte-Carlo return G (γ = 0.99),\n"
        "by position: d0 … d9 the deciles of each response's valid tokens, last its last valid token, all every one:",
        "step     all\n   1   0.250\n   2  -1.500",
        "tokens by position:",
        "step  all\n   1   10\n   2   12",
        "mean |V − G| by position:",
        "step    all\n   1  0.300\n   2  0.700",
    ])  # fmt: skip
    assert vi.critic_report(diagnostics, 0.99, "text", 3) == expected
    assert vi.critic_report(diagnostics, 0.99, "csv") == (
        "step,bucket,tokens,explained_var,mean_abs_error,mean_return,mean_value\n1,all,10,0.25,0.3,0.5,0.2\n2,all,12,-1.5,0.7,0.5,0.2"
    )
