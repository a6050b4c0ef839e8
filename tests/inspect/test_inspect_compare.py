"""``verl-ext compare`` / ``verl_ext.inspect.compare`` (module ``comparison``) on a synthetic trace with holes (interior masked
tokens), against the direct sums of tests/support/reference.py. The same on a real trace of verl's trainer,
with groups of four responses per prompt: tests/apps/test_learning.py."""

from __future__ import annotations

import numpy as np
import pytest

import tests.support.reference as ref
from tests.inspect.inspect_helpers import algorithm, by_definition, random_batch, write_trace
from tests.support.registry_helpers import isolated_registry  # noqa: F401 - a fixture
from verl_ext.errors import UsageError
from verl_ext.inspect import compare

GAMMA = 0.9


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    batch = by_definition(random_batch(3, B=6, T=16), "gae_ext", GAMMA, lam=0.7)
    path = write_trace(tmp_path_factory.mktemp("cmp"), algorithm("gae_ext", gamma=GAMMA, lam=0.7), {4: batch})
    return path, batch


def reference_columns(batch, n=3, lambdas=(0.5, 0.9, 0.95)) -> dict[str, np.ndarray]:
    rewards, values, mask = batch.rewards.double().numpy(), batch.values.double().numpy(), batch.mask.numpy()
    columns = {
        "mc": ref.mc_returns(rewards, mask, GAMMA) - values,
        "td0": ref.td0_returns(rewards, values, mask, GAMMA) - values,
        f"nstep{n}": ref.nstep_returns(rewards, values, mask, GAMMA, n) - values,
        **{f"gae{lam:g}": ref.gae_advantages(rewards, values, mask, GAMMA, lam) for lam in lambdas},
        "turn_gae": ref.turn_gae_advantages(rewards, values, mask, GAMMA, 1.0),
    }
    return columns


def test_every_estimator_matches_the_direct_sums_on_every_valid_token(traced):
    path, batch = traced
    result = compare(path, step=4, sample=1)
    expected = reference_columns(batch)
    assert result.labels == ("mc", "td0", "nstep3", "gae0.5", "gae0.9", "gae0.95", "turn_gae", "gae0.7")  # + the run's own
    expected["gae0.7"] = ref.gae_advantages(batch.rewards.double().numpy(), batch.values.double().numpy(), batch.mask.numpy(), GAMMA, 0.7)
    mask = batch.mask.numpy() != 0
    table = result.table.to_pandas()
    positions = np.flatnonzero(mask[1])
    assert table["token_index"].tolist() == positions.tolist()  # the hole is left out
    for label in result.labels:
        np.testing.assert_allclose(table[label], expected[label][1, positions], rtol=1e-10, atol=1e-12)
    statistics = result.statistics.to_pandas().set_index("estimator")
    for label in result.labels:
        valid = expected[label][mask]
        assert statistics.at[label, "var_batch"] == pytest.approx(np.var(valid, ddof=1), rel=1e-10)
        assert statistics.at[label, "mean_abs"] == pytest.approx(np.abs(valid).mean(), rel=1e-10)
        assert np.isnan(statistics.at[label, "var_within_group"])  # one response per prompt: no group
        per_position = np.abs(np.where(mask, expected[label], 0.0)).sum(axis=0)
        np.testing.assert_allclose(result.shares.column(label).to_numpy(), per_position / per_position.sum(), rtol=1e-10)
    matrix = np.corrcoef([expected[label][mask] for label in result.labels])
    np.testing.assert_allclose(result.correlation.to_pandas()[list(result.labels)].to_numpy(), matrix, rtol=1e-9)


def test_gae_at_lambda_one_and_zero_are_mc_and_td0(traced):
    path, _ = traced
    table = compare(path, step=4, lambdas=(0.0, 1.0)).table.to_pandas()
    np.testing.assert_allclose(table["gae1"], table["mc"], atol=1e-12)
    np.testing.assert_allclose(table["gae0"], table["td0"], atol=1e-12)


def test_csv_has_one_row_per_token_and_one_column_per_estimator(traced, run_cli):
    path, batch = traced
    code, out, _ = run_cli("compare", path, "--step", "4", "--sample", "1", "--n", "2", "--lambdas", "0.95", "--format", "csv")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0] == "token_index,token,mc,td0,nstep2,gae0.95,turn_gae,gae0.7"
    assert len(lines) - 1 == int(batch.mask[1].sum())
    expected = reference_columns(batch, n=2, lambdas=(0.95,))["nstep2"][1, np.flatnonzero(batch.mask[1].numpy())]
    np.testing.assert_allclose([float(line.split(",")[4]) for line in lines[1:]], expected, rtol=1e-6)


def test_the_text_report_and_the_plot(traced, run_cli, tmp_path):
    path, _ = traced
    code, out, _ = run_cli("compare", path, "--step", "4", "--plot", str(tmp_path / "cmp.png"))
    assert code == 0
    for heading in ("raw advantages (before whitening) by estimator", "var_batch", "share of the step's", "correlation",
                    "note: no prompt has two responses at this step: var_within_group is empty"):
        assert heading in out
    assert (tmp_path / "cmp.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--step", "9"], "step 9"),
        (["--step", "4", "--sample", "99"], "no valid tokens of sample 99"),
        (["--step", "4", "--lambdas", "0.5,2"], "every λ must be in [0, 1]"),
        (["--step", "4", "--n", "0"], "must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(traced, run_cli, argv, message):
    path, _ = traced
    try:
        code, _, err = run_cli("compare", path, *argv)
    except SystemExit as exit_info:  # argparse's own checks
        code, err = exit_info.code, ""
    assert code == 2
    if err:
        assert message in err and err.count("\n") == 1


def test_a_critic_free_step_cannot_be_re_estimated(tmp_path):
    batch = random_batch(5)
    batch.values = None
    batch.returns = batch.advantage_raw = batch.advantages = batch.rewards
    path = write_trace(tmp_path / "grpo", algorithm("grpo"), {1: batch})
    with pytest.raises(UsageError, match="no rewards or values"):
        compare(path, step=1)


def test_var_within_group_is_the_mean_variance_of_the_groups_of_two_or_more_responses():
    """estimator_statistics' var_within_group against the definition, group by group: uids as
    strings or integer codes, groups of one response left out, a step without groups empty."""
    from verl_ext.inspect.comparison import estimator_statistics

    rng = np.random.default_rng(0)
    lengths = [3, 5, 2, 4, 6, 1, 3]
    uid_of = ["a", "a", "b", "c", "c", "c", "d"]  # b and d: one response each
    samples = np.repeat(np.arange(len(lengths)), lengths)
    uid = np.array([uid_of[s] for s in samples], dtype=object)
    values = rng.normal(size=len(samples))
    expected = np.mean([np.var(values[uid == g], ddof=1) for g in ("a", "c")])
    table, notes = estimator_statistics({"x": values}, uid, samples)
    assert table.column("var_within_group")[0].as_py() == pytest.approx(expected, rel=1e-12) and notes == []
    codes = np.array([{"a": 7, "b": 3, "c": 0, "d": 9}[u] for u in uid])
    assert estimator_statistics({"x": values}, codes, samples)[0].column("var_within_group")[0].as_py() == pytest.approx(expected, rel=1e-12)
    alone = np.array([f"u{s}" for s in samples], dtype=object)
    table, notes = estimator_statistics({"x": values}, alone, samples)
    assert table.column("var_within_group")[0].as_py() is None and "no prompt has two responses" in notes[0]


# --------------------------------------------------------------------------- a user's estimator


def register_user_estimators(registry):
    """``scaled_reward`` (an option with a default) and ``needs_k`` (an option without one)."""
    from verl_ext.options import Option, number, positive_int

    @registry.register_estimator("scaled_reward", options=(Option("scale", number, default=1.0),))
    def scaled_reward(rewards, values, response_mask, *, gamma, lam, config):
        returns = config["scale"] * rewards
        return returns, returns - values

    @registry.register_estimator("needs_k", options=(Option("k", positive_int, required=True),))
    def needs_k(rewards, values, response_mask, *, gamma, lam, config):
        raise AssertionError("compare has no k to give it")


def test_a_registered_estimator_is_compared_at_its_defaults(traced, isolated_registry):
    register_user_estimators(isolated_registry)
    path, batch = traced
    result = compare(path, step=4, sample=1)
    assert result.labels == ("mc", "td0", "nstep3", "gae0.5", "gae0.9", "gae0.95", "turn_gae", "scaled_reward", "gae0.7")
    assert any(note.startswith("needs_k is not compared: ") and "needs algorithm.k" in note for note in result.notes)
    mask = batch.mask.numpy() != 0
    expected = batch.rewards.double().numpy() - batch.values.double().numpy()  # scale 1: r_t − V(s_t)
    positions = np.flatnonzero(mask[1])
    np.testing.assert_allclose(result.table.to_pandas()["scaled_reward"], expected[1, positions], rtol=1e-10, atol=1e-12)
    statistics = result.statistics.to_pandas().set_index("estimator")
    assert statistics.at["scaled_reward", "mean_abs"] == pytest.approx(np.abs(expected[mask]).mean(), rel=1e-10)


def test_a_run_of_a_registered_estimator_is_compared_at_the_runs_settings(traced, isolated_registry, tmp_path):
    register_user_estimators(isolated_registry)
    _, batch = traced
    path = write_trace(tmp_path / "user", algorithm("scaled_reward", gamma=GAMMA, scale=3.0), {2: batch})
    result = compare(path, step=2, sample=0)
    assert result.labels == ("mc", "td0", "nstep3", "gae0.5", "gae0.9", "gae0.95", "turn_gae", "scaled_reward")  # one column, the run's
    mask = batch.mask.numpy() != 0
    expected = 3.0 * batch.rewards.double().numpy() - batch.values.double().numpy()
    np.testing.assert_allclose(result.table.to_pandas()["scaled_reward"], expected[0, np.flatnonzero(mask[0])], rtol=1e-10, atol=1e-12)


def test_a_turn_gae_run_is_compared_beside_the_token_level_estimators(tmp_path):
    """A run of turn_gae (responses of up to four turns): compare's column (λ = 1) and the run's own at
    its λ, each equal to the direct sums over turns and constant on each turn."""
    batch = by_definition(random_batch(5, B=6, T=30, holes=3), "turn_gae", GAMMA, lam=0.7)
    path = write_trace(tmp_path / "turns", algorithm("turn_gae", gamma=GAMMA, lam=0.7), {1: batch})
    result = compare(path, step=1, sample=1)
    assert result.labels[-2:] == ("turn_gae", "turn_gae0.7")
    rewards, values, mask = batch.rewards.double().numpy(), batch.values.double().numpy(), batch.mask.numpy()
    positions = np.flatnonzero(mask[1])
    table = result.table.to_pandas()
    for label, lam in (("turn_gae", 1.0), ("turn_gae0.7", 0.7)):
        expected = ref.turn_gae_advantages(rewards, values, mask, GAMMA, lam)[1, positions]
        np.testing.assert_allclose(table[label], expected, rtol=1e-10, atol=1e-12)
    assert len(ref.turns_of_row(mask[1])) >= 3 and table["turn_gae0.7"].nunique() == len(ref.turns_of_row(mask[1]))
