"""The critic against the Monte-Carlo return, by position (verl_ext.inspect.critic), against numbers
computed here: G_t as the direct sum over each response's compacted valid tokens, the buckets from
their definition, variances with the standard library."""

from __future__ import annotations

import statistics
from dataclasses import replace

import numpy as np
import pytest
import torch
from tests.inspect.inspect_helpers import Batch, algorithm, by_definition, random_batch, write_trace

import verl_ext.inspect as vi
from verl_ext.errors import UsageError
from verl_ext.inspect.critic import BUCKETS, CRITIC_SCHEMA, critic_diagnostics, steps_by_bucket
from verl_ext.inspect.summary import summarize
from verl_ext.step_metrics import explained_variance

GAMMA = 0.9


# ---------------------------------------------------------------- the expected numbers, from the definitions


def expected_rows(step: int, batch: Batch, gamma: float) -> list[dict]:
    """Per bucket: tokens, EV (from 8 tokens on), mean |V − G|, mean G, mean V; G_t = Σ_{k≥t} γ^{k−t} r_k summed
    directly over each response's valid tokens (interior holes skipped), decile ⌊10·i/L⌋; where a
    response has a hole, turn k's first valid token (the k-th after a masked position) in turn{k}
    and, for k ≥ 1, in after_hole."""
    members = {bucket: [] for bucket in BUCKETS}  # (G, V) pairs
    for b in range(len(batch.mask)):
        valid = [t for t in range(batch.mask.shape[1]) if batch.mask[b, t] != 0]
        r = [float(batch.rewards[b, t]) for t in valid]
        v = [float(batch.values[b, t]) for t in valid]
        L = len(valid)
        turn = -1
        for i in range(L):
            g = sum(gamma ** (k - i) * r[k] for k in range(i, L))
            members[f"d{10 * i // L}"].append((g, v[i]))
            members["all"].append((g, v[i]))
            if i == L - 1:
                members["last"].append((g, v[i]))
            if i == 0 or valid[i - 1] != valid[i] - 1:  # a turn begins
                turn += 1
                members.setdefault(f"turn{turn}", []).append((g, v[i]))
                if turn:
                    members.setdefault("after_hole", []).append((g, v[i]))
    turns = [bucket for bucket in members if bucket.startswith("turn")]
    rows = []
    for bucket in [*BUCKETS, *(sorted(turns, key=lambda b: int(b[4:])) + ["after_hole"] if "turn1" in members else [])]:
        g = [pair[0] for pair in members[bucket]]
        v = [pair[1] for pair in members[bucket]]
        n = len(g)
        ev = None
        if n >= 8 and statistics.variance(g) > 0:  # docs/definitions.md §9: a bucket's EV needs 8 tokens
            ev = 1 - statistics.variance([gi - vi for gi, vi in zip(g, v)]) / statistics.variance(g)
        rows.append({
            "step": step, "bucket": bucket, "tokens": n, "explained_var": ev,
            "mean_abs_error": statistics.fmean(abs(vi - gi) for gi, vi in zip(g, v)) if n else None,
            "mean_return": statistics.fmean(g) if n else None, "mean_value": statistics.fmean(v) if n else None,
        })  # fmt: skip
    return rows


def assert_rows(actual: list[dict], expected: list[dict]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        assert got.keys() == want.keys()
        for key, value in want.items():
            if value is None or isinstance(value, (int, str)):
                assert got[key] == value, (want["step"], want["bucket"], key)
            else:
                assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (want["step"], want["bucket"], key)


@pytest.fixture
def batches() -> dict[int, Batch]:
    """Three steps of responses of different lengths (8 … 24 valid tokens), interior holes in every
    other response, different batch sizes (11 … 13: a bucket's EV needs 8 tokens); an mc run with γ = 0.9."""
    return {step: by_definition(random_batch(step, B=10 + step, T=24), "mc", GAMMA) for step in (1, 2, 3)}


@pytest.fixture
def mc_trace(tmp_path, batches) -> str:
    return write_trace(tmp_path / "t", algorithm("mc", gamma=GAMMA), batches)


def hand_trace(directory, estimator: str = "mc") -> str:
    """Two responses, γ = 0.5 (· masked, an interior hole in response 1):
    response 0: rewards [0, 0, 1],    values [0.2, 0.4, 0.6]  ->  G = [0.25, 0.5, 1]
    response 1: rewards [0, ·, 0.5],  values [0.1, ·, 0.3]    ->  G = [0.25, ·, 0.5]  (the hole skipped)"""
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 1]])
    rewards = torch.tensor([[0.0, 0, 1], [0, 0, 0.5]])
    values = torch.tensor([[0.2, 0.4, 0.6], [0.1, 7, 0.3]])
    ids, prompt = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 1, dtype=torch.long)
    b = Batch(mask, ids, prompt, torch.ones(2, 1) > 0, rewards, None, rewards.clone(), values)
    b = by_definition(b, estimator, gamma=0.5, whitened=False)
    return write_trace(directory, algorithm(estimator, gamma=0.5, whiten_advantages=False), {7: b})


def critic_free_trace(directory) -> str:
    b = random_batch(1)
    b = replace(b, values=None, returns=b.scores, advantages=b.scores, advantage_raw=None)
    return write_trace(directory, algorithm("grpo"), {1: b})


# ---------------------------------------------------------------- the numbers


def test_by_hand(tmp_path):
    rows = {row["bucket"]: row for row in critic_diagnostics(hand_trace(tmp_path / "t")).to_pylist()}
    assert list(rows) == [*BUCKETS, "turn0", "turn1", "after_hole"]
    # turns: response 1's hole makes its last token the first of its turn 1: turn0 G = [.25, .25],
    # V = [.2, .1]; turn1 and after_hole G = [.5], V = [.3]
    assert (rows["turn0"]["tokens"], rows["turn0"]["explained_var"]) == (2, None)
    assert rows["turn0"]["mean_abs_error"] == pytest.approx(0.1)
    for bucket in ("turn1", "after_hole"):
        assert (rows[bucket]["tokens"], rows[bucket]["mean_return"], rows[bucket]["mean_value"]) == pytest.approx((1, 0.5, 0.3))
    # all: G = [.25, .5, 1, .25, .5], V = [.2, .4, .6, .1, .3]; G − V = [.05, .1, .4, .15, .2]
    # Var(G) = (.0625 + 0 + .25 + .0625 + 0)/4 = .09375; Var(G − V) = (.0169 + .0064 + .0484 + .0009 + .0004)/4 = .01825
    # 5 tokens, fewer than the 8 a bucket's EV needs (docs/definitions.md §9): blank; the formula on them
    assert rows["all"]["explained_var"] is None and rows["all"]["tokens"] == 5
    G, V = np.array([0.25, 0.5, 1, 0.25, 0.5]), np.array([0.2, 0.4, 0.6, 0.1, 0.3])
    assert explained_variance(V, G) == pytest.approx(1 - 0.01825 / 0.09375)
    assert rows["all"]["mean_abs_error"] == pytest.approx(0.18)
    assert (rows["all"]["mean_return"], rows["all"]["mean_value"]) == pytest.approx((0.5, 0.32))
    # last: G = [1, .5], V = [.6, .3]: Var(G) = .125, Var(G − V) = Var([.4, .2]) = .02
    assert rows["last"]["tokens"] == 2
    assert rows["last"]["explained_var"] is None  # 2 tokens
    assert explained_variance(np.array([0.6, 0.3]), np.array([1.0, 0.5])) == pytest.approx(1 - 0.02 / 0.125)
    assert rows["last"]["mean_abs_error"] == pytest.approx(0.3)
    # deciles: response 0 (L = 3) ranks 0, 1, 2 -> d0, d3, d6; response 1 (L = 2) ranks 0, 1 -> d0, d5
    assert {b: r["tokens"] for b, r in rows.items() if r["tokens"] and b in BUCKETS} == {"d0": 2, "d3": 1, "d5": 1, "d6": 1, "last": 2, "all": 5}
    assert rows["d0"]["explained_var"] is None  # G = [.25, .25] does not vary
    assert rows["d0"]["mean_abs_error"] == pytest.approx((0.05 + 0.15) / 2)
    assert rows["d3"]["explained_var"] is None and rows["d3"]["mean_abs_error"] == pytest.approx(0.1)  # one token
    assert rows["d1"] == {"step": 7, "bucket": "d1", "tokens": 0, "explained_var": None, "mean_abs_error": None,
                          "mean_return": None, "mean_value": None}  # fmt: skip


def test_against_direct_sums_with_holes_and_discount(mc_trace, batches):
    seen = []
    table = critic_diagnostics(mc_trace, progress=lambda done, total, tokens: seen.append((done, total, tokens)))
    assert table.schema == CRITIC_SCHEMA
    expected = [row for step, batch in batches.items() for row in expected_rows(step, batch, GAMMA)]
    assert_rows(table.to_pylist(), expected)
    tokens = [int(batches[s].mask.sum()) for s in (1, 2, 3)]
    assert seen == [(1, 3, tokens[0]), (2, 3, tokens[0] + tokens[1]), (3, 3, sum(tokens))]
    # a subset of steps, and the Python API's names
    assert_rows(vi.critic_diagnostics(mc_trace, steps=[2]).to_pylist(), expected_rows(2, batches[2], GAMMA))


def test_the_yardstick_is_the_mc_return_whatever_the_estimator(tmp_path, batches):
    """A td0 run records td0 targets as its returns; the diagnostic still compares V with G."""
    td0 = {step: by_definition(batch, "td0", GAMMA) for step, batch in batches.items()}
    path = write_trace(tmp_path / "t", algorithm("td0", gamma=GAMMA), td0)
    expected = [row for step, batch in td0.items() for row in expected_rows(step, batch, GAMMA)]
    assert_rows(critic_diagnostics(path).to_pylist(), expected)
    summary = summarize(path).to_pylist()
    for row, step in zip(summary, td0):
        by_bucket = {r["bucket"]: r for r in expected_rows(step, td0[step], GAMMA)}
        assert row["ev_mc"] == pytest.approx(by_bucket["all"]["explained_var"], rel=1e-9)
        assert row["ev_mc_last"] == pytest.approx(by_bucket["last"]["explained_var"], rel=1e-9)
        assert row["ev_mc"] != pytest.approx(row["explained_var"])  # against the td0 targets: another number


def test_steps_by_bucket(mc_trace, batches):
    diagnostics = critic_diagnostics(mc_trace)
    wide = steps_by_bucket(diagnostics, "mean_abs_error")
    assert wide.column_names == ["step", *BUCKETS, "turn0", "turn1", "after_hole"]  # random_batch: one hole
    assert wide.column("step").to_pylist() == [1, 2, 3]
    for i, step in enumerate((1, 2, 3)):
        for row in expected_rows(step, batches[step], GAMMA):
            assert wide.column(row["bucket"])[i].as_py() == pytest.approx(row["mean_abs_error"], rel=1e-9)
    assert steps_by_bucket(diagnostics).column("all").to_pylist() == pytest.approx(
        [r["explained_var"] for s in (1, 2, 3) for r in expected_rows(s, batches[s], GAMMA) if r["bucket"] == "all"]
    )
    with pytest.raises(UsageError, match="unknown metric 'ev'"):
        steps_by_bucket(diagnostics, "ev")


# ---------------------------------------------------------------- summary, CLI, plot, errors


def test_summary_columns(tmp_path, mc_trace, batches):
    rows = summarize(mc_trace).to_pylist()
    for row, step in zip(rows, (1, 2, 3)):
        by_bucket = {r["bucket"]: r for r in expected_rows(step, batches[step], GAMMA)}
        assert row["ev_mc"] == pytest.approx(by_bucket["all"]["explained_var"], rel=1e-9)
        assert row["ev_mc_last"] == pytest.approx(by_bucket["last"]["explained_var"], rel=1e-9)
        assert row["ev_mc"] == pytest.approx(row["explained_var"], rel=1e-5, abs=1e-6)  # mc: the returns are G in float32
    row = summarize(critic_free_trace(tmp_path / "g")).to_pylist()[0]
    assert row["ev_mc"] is None and row["ev_mc_last"] is None and row["explained_var"] is None


def test_summary_critic_command(tmp_path, run_cli):
    path = hand_trace(tmp_path / "t")
    code, out, err = run_cli("summary", path, "--critic")
    assert code == 0 and err == ""
    header, title, ev, note, tokens_title, tokens, mae_title, mae = out.strip().split("\n\n")
    assert header == "rollout:  not recorded (the run record does not say)\nfinished: unknown (the run record does not say)"
    assert title.startswith("explained variance 1 − Var(G − V)/Var(G)") and "(γ = 0.5)" in title
    # text drops the columns that are null in every step: here every bucket, none of 8 tokens or more
    assert ev.splitlines() == ["step", "   7"]
    # the buckets with 1 to 7 tokens (counted by hand below): d0, d3, d5, d6, last, all, turn0, turn1, after_hole
    assert note == (
        "note: EV is blank where a bucket holds fewer than 8 tokens (9 step × bucket cells here): on a handful of "
        "returns it swings far below −1 and says nothing (docs/definitions.md §9)"
    )
    assert tokens_title == "tokens by position:"
    assert tokens.splitlines()[0].split() == ["step", *BUCKETS, "turn0", "turn1", "after_hole"]
    # response 0 (L = 3): d0, d3, d6; response 1 (L = 2): d0, d5; a last token each; turn0 both, turn1 response 1
    assert tokens.splitlines()[1].split() == ["7", "2", "0", "0", "1", "0", "1", "1", "0", "0", "0", "2", "5", "2", "1", "1"]
    assert mae_title == "mean |V − G| by position:"
    assert mae.splitlines()[0].split() == ["step", "d0", "d3", "d5", "d6", "last", "all", "turn0", "turn1", "after_hole"]
    assert mae.splitlines()[1].split() == ["7", "0.1000", "0.1000", "0.2000", "0.4000", "0.3000", "0.1800", "0.1000", "0.2000", "0.2000"]

    code, out, _ = run_cli("summary", path, "--critic", "--format", "csv")
    lines = out.splitlines()
    assert lines[0] == "step,bucket,tokens,explained_var,mean_abs_error,mean_return,mean_value"
    assert [line.split(",")[1] for line in lines[1:]] == [*BUCKETS, "turn0", "turn1", "after_hole"]
    assert lines[1 + BUCKETS.index("d1")] == "7,d1,0,,,,"
    assert lines[1 + BUCKETS.index("last")].split(",")[:4] == ["7", "last", "2", ""]  # 2 tokens: no EV

    code, out, _ = run_cli("summary", path, "--critic", "--format", "markdown", "--digits", "2")
    assert "| step | d0 | d1 | d2 | d3 |" in out and "| 7 | 0.10 | 0.10 | 0.20 | 0.40 | 0.30 | 0.18 |" in out


def test_summary_critic_command_shows_the_buckets_of_eight_tokens(mc_trace, batches, run_cli):
    """11 to 13 responses a step: the EV of every bucket with 8 tokens or more, blank below."""
    code, out, _ = run_cli("summary", mc_trace, "--critic", "--format", "markdown", "--digits", "6")
    table = [line.strip("|").split("|") for line in out.split("\n\n")[2].splitlines()]  # after the run's header and the title
    columns = [cell.strip() for cell in table[0]]
    shown = {(int(cells[0]), column): cell.strip() for cells in table[2:] for column, cell in zip(columns, cells)}
    blank = 0
    for step in (1, 2, 3):
        for row in expected_rows(step, batches[step], GAMMA):
            cell = shown.get((step, row["bucket"]), "")  # a column blank on every step is left out
            if row["explained_var"] is None:
                assert cell == "", (step, row["bucket"])
                blank += 0 < row["tokens"] < 8
            else:
                assert float(cell) == pytest.approx(row["explained_var"], abs=5e-7), (step, row["bucket"])
    assert {"last", "all"} <= set(columns) and blank  # some buckets shown, some blanked for their few tokens


def test_plot_draws_the_matrix(mc_trace, batches, tmp_path, run_cli):
    from verl_ext.inspect import plots

    figure = plots.critic_heatmap(mc_trace)
    ev_axis, mae_axis = [axis for axis in figure.axes if axis.images]
    ev_image, mae_image = ev_axis.images[0], mae_axis.images[0]
    assert ev_image.norm.vmin == -1 and ev_image.norm.vmax == 1 and ev_image.get_cmap().name.startswith("RdBu")
    assert [t.get_text() for t in ev_axis.get_xticklabels()] == [*BUCKETS, "turn0", "turn1", "after_hole"]
    for i, step in enumerate((1, 2, 3)):
        for j, row in enumerate(expected_rows(step, batches[step], GAMMA)):
            for image, metric in ((ev_image, "explained_var"), (mae_image, "mean_abs_error")):
                want = float("nan") if row[metric] is None else row[metric]
                assert float(image.get_array()[i, j]) == pytest.approx(want, rel=1e-9, nan_ok=True)

    code, out, _ = run_cli("plot", mc_trace, "--out", str(tmp_path / "plots"), "--quiet")
    assert code == 0
    written = [line for line in out.splitlines() if line.endswith("critic_ev.png")]
    assert len(written) == 1
    with open(written[0], "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_a_critic_is_a_clear_error(tmp_path, run_cli):
    path = critic_free_trace(tmp_path / "g")
    with pytest.raises(UsageError, match=r"step 1 has no values: nothing to compare the critic with \(adv_estimator=grpo"):
        critic_diagnostics(path)
    code, out, err = run_cli("summary", path, "--critic")
    assert code == 2 and out == ""
    assert err.startswith("verl-ext summary: step 1 has no values") and len(err.strip().splitlines()) == 1


def test_the_traced_metrics_of_a_multi_turn_step_follow_the_definitions(tmp_path):
    """Up to four turns a response: the post-hoc live metrics (turn{k}, after_hole, the turn shares
    among them) against tests/support/reference.py's direct sums on the tensors written."""
    import tests.support.reference as ref
    from verl_ext.inspect.critic import traced_step_metrics

    batch = by_definition(random_batch(1, B=24, T=30, holes=3), "mc", GAMMA)  # turn1 in 8 responses or more
    path = write_trace(tmp_path / "t", algorithm("mc", gamma=GAMMA), {1: batch})
    got = traced_step_metrics(path, 1)
    arrays = [None if x is None else x.double().numpy() for x in (batch.rewards, batch.values, batch.advantage_raw, batch.advantages, batch.scores, batch.mask)]
    want = ref.live_metrics(*arrays[:5], arrays[5], [f"u{i}" for i in range(24)], GAMMA)
    assert {"critic/ev_mc/turn1", "critic/ev_mc/after_hole", "credit/share/turn2"} <= set(want), sorted(want)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key  # the trace holds float32
