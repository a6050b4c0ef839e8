"""registry.py: registration on the definition, the conflict check, unknown names, verl's described
estimators, option checking for any estimator, column labels and the columns of ``compare``, and
``run``'s checks of an estimator's outputs. Expected values by hand. (A user's estimator inside verl:
tests/integration/test_user_estimator.py; the estimators' numbers: tests/test_estimators.py.)"""

from __future__ import annotations

import enum
import re

import pytest
import torch

from tests.support.registry_helpers import isolated_registry  # noqa: F401 - a fixture
from verl_ext import builtin_estimators, estimators, registry
from verl_ext.steps.as_run import column_label, compared_settings
from verl_ext.options import TRUNCATION

# --------------------------------------------------------------------------- registering


def test_the_decorator_registers_the_function_as_defined(isolated_registry):
    @isolated_registry.register_estimator("halved_reward", needs_critic=False)
    def halved_reward(rewards, values, response_mask, *, gamma, lam, config):
        """Half   the reward,
        as the return.

        Not part of the formula."""
        return rewards / 2, rewards / 2

    entry = isolated_registry.lookup("halved_reward")
    assert entry.fn is halved_reward  # the decorator returned the function itself
    assert entry.name == "halved_reward" and not entry.needs_critic and entry.module == __name__
    assert entry.formula == "Half the reward, as the return."  # the docstring's first paragraph, one line
    assert isolated_registry.names() == ("mc", "td0", "nstep", "gae_ext", "turn_gae", "halved_reward")


def test_a_second_function_under_a_taken_name_is_refused_naming_both(isolated_registry):
    def mc(rewards, values, response_mask, *, gamma, lam, config):
        return rewards, rewards

    message = (
        "estimator 'mc' is already registered by verl_ext.builtin_estimators.mc; cannot register "
        f"{__name__}.test_a_second_function_under_a_taken_name_is_refused_naming_both.<locals>.mc under the same name"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        isolated_registry.register_estimator("mc")(mc)
    assert isolated_registry.get("mc").fn is builtin_estimators.mc  # the built-in stays


def test_only_a_function_can_be_registered(isolated_registry):
    with pytest.raises(TypeError, match=r"register_estimator\('five'\) decorates a function, got 5"):
        isolated_registry.register_estimator("five")(5)
    assert isolated_registry.lookup("five") is None


def test_a_name_a_listener_refuses_is_not_registered(isolated_registry):
    """verl's registry listens (integration/patches.py); when it refuses a name, verl-ext holds none either."""

    def refuse(estimator):
        raise ValueError(f"refused {estimator.name!r}")

    isolated_registry.on_register(refuse)
    with pytest.raises(ValueError, match="refused 'taken'"):
        isolated_registry.register_estimator("taken")(lambda *a, **k: None)
    assert isolated_registry.lookup("taken") is None and isolated_registry.names() == ("mc", "td0", "nstep", "gae_ext", "turn_gae")


def test_the_name_of_an_enum_member_is_its_value():
    """verl passes algorithm.adv_estimator as a string or as an AdvantageEstimator member."""

    class Names(enum.Enum):
        GAE = "gae"

    assert registry.name_of(Names.GAE) == "gae" and registry.name_of("mc") == "mc"


def test_registry_rejects_a_second_function_under_a_taken_name_and_lists_names():
    with pytest.raises(ValueError, match="'mc' is already registered by verl_ext.builtin_estimators.mc"):
        registry.register_estimator("mc")(lambda *a, **k: None)
    registry.register_estimator("mc")(registry.get("mc").fn)  # the same function again: a no-op
    with pytest.raises(ValueError, match="'nope' is not an estimator verl-ext knows; known: mc, td0, nstep, gae_ext, turn_gae, gae, grpo"):
        registry.get("nope")
    with pytest.raises(ValueError, match="non-empty string"):
        registry.register_estimator(" ")


def test_verls_estimators_are_described_not_registered():
    """gae and grpo have entries (what verl-ext knows of them) but are not verl-ext's: not among the
    names it registers into verl, options and whitening are verl's (verl-ext's algorithm.truncation is read
    by every estimator it knows)."""
    assert registry.names() == ("mc", "td0", "nstep", "gae_ext", "turn_gae")
    gae, grpo = registry.lookup("gae"), registry.lookup("grpo")
    assert gae.computed_by_verl and gae.needs_critic and gae.recomputable and gae.all_options == (TRUNCATION,)
    assert grpo.computed_by_verl and not grpo.needs_critic and not grpo.recomputable and grpo.all_options == (TRUNCATION,)
    assert grpo.settings({"whiten_advantages": True})["whiten_advantages"] is None  # verl-ext cannot tell
    assert registry.lookup("rloo") is None
    assert registry.check_algorithm({"adv_estimator": "gae", "lam": 0.9}) is None  # verl's: nothing to parse


def test_a_name_of_verl_means_verls_estimator_even_where_a_function_took_it(isolated_registry):
    """Without the plugin (a checker's process) nothing refuses register_estimator("gae"); a trace of
    gae is still verl's gae, as verl refuses the name to anyone else in a run."""
    isolated_registry.register_estimator("gae")(lambda *a, **k: None)
    assert isolated_registry.lookup("gae").computed_by_verl
    assert isolated_registry.get("gae").fn is not None and isolated_registry.get("gae").verl_whitens


# --------------------------------------------------------------------------- settings, descriptions, columns


@pytest.mark.parametrize(
    "name, settings, label",
    [
        ("mc", {}, "mc"),
        ("nstep", {"n_step": 5}, "nstep5"),
        ("gae_ext", {"lam": 0.9}, "gae0.9"),
        ("gae_ext", {"lam": 1.0, "lam_critic": 0.8, "lam_actor": 0.8}, "gae0.8"),  # one λ: plain GAE(0.8)
        ("gae_ext", {"lam": 0.9, "lam_critic": 1.0}, "gae_ext"),
        ("gae", {"lam": 0.95}, "gae0.95"),
        ("turn_gae", {"lam": 1.0}, "turn_gae"),
        ("turn_gae", {"lam": 0.9}, "turn_gae0.9"),
        ("turn_gae", {"lam": 0.9, "lam_critic": 1.0}, "turn_gae0.9"),  # λ_critic moves the returns only
    ],
)
def test_a_compare_label_names_the_numbers(name, settings, label):
    """Two settings with the same label give the same raw advantage: gae_ext with one λ is GAE(λ)."""
    entry = registry.get(name)
    assert column_label(entry, entry.settings({"gamma": 0.9, **settings})) == label


@pytest.mark.parametrize(
    "algorithm, message",
    [
        ({"adv_estimator": "nstep"}, "needs algorithm.n_step"),
        ({"adv_estimator": "nstep", "n_step": 0}, "algorithm.n_step must be an integer >= 1, got 0"),
        ({"adv_estimator": "gae_ext", "lam_actor": 1.5}, r"algorithm.lam_actor must be in \[0, 1\], got 1.5"),
        ({"adv_estimator": "mc", "gamma": "x"}, "algorithm.gamma must be a number, got 'x'"),
        ({"adv_estimator": "mc", "whiten_advantages": "yes"}, "algorithm.whiten_advantages must be true or false"),
    ],
)
def test_settings_name_the_bad_key(algorithm, message):
    with pytest.raises(ValueError, match=message):
        registry.check_algorithm(algorithm)


def test_verl_ext_options_are_checked_with_verls_own_estimators():
    with pytest.raises(ValueError, match=r"algorithm.n_step must be an integer >= 1, got -5"):
        registry.check_algorithm({"adv_estimator": "gae", "n_step": -5, "lam_critic": 7})
    with pytest.raises(ValueError, match=r"algorithm.lam_critic must be in \[0, 1\], got 7"):
        registry.check_algorithm({"adv_estimator": "gae", "lam_critic": 7})
    with pytest.warns(UserWarning, match="algorithm.adv_estimator=gae ignores algorithm.n_step"):
        registry.check_algorithm({"adv_estimator": "gae", "n_step": 5, "whiten_advantages": True})


@pytest.mark.parametrize(
    "name, algorithm, description",
    [
        ("nstep", {"gamma": 0.99, "n_step": 3}, "nstep(γ=0.99, n_step=3)"),  # λ does not matter to it
        ("gae_ext", {"gamma": 0.9, "lam": 0.95, "lam_critic": 1.0}, "gae_ext(γ=0.9, λ=0.95, lam_critic=1)"),
        ("mc", {"lam": 0.5}, "mc(γ=1)"),
    ],
)
def test_a_description_names_the_settings_that_determine_the_numbers(name, algorithm, description):
    entry = registry.get(name)
    assert entry.describe(entry.settings(algorithm)) == description


def test_an_estimator_with_its_own_lambda_is_not_described_with_the_runs(isolated_registry):
    """The README's td_half fixes λ = 0.5 and never reads ``lam``: its description names no λ (the run's
    λ = 1 would say what it does not use). One that reads ``lam``, or ``config`` (which holds it), is
    described with it; ``uses_lam`` says it outright."""
    from tests.integration.test_user_estimator import readme_example

    namespace: dict = {"__name__": "my_estimators"}
    exec(compile(readme_example(), "my_estimators.py", "exec"), namespace)  # registers td_half, as importing it does
    td_half = isolated_registry.get("td_half")
    assert td_half.describe(td_half.settings({"gamma": 1.0, "lam": 1.0})) == "td_half(γ=1)"

    @isolated_registry.register_estimator("td_lam")
    def td_lam(rewards, values, response_mask, *, gamma, lam, config):
        return estimators.gae(rewards, values, response_mask, gamma, lam)

    @isolated_registry.register_estimator("td_configured")
    def td_configured(rewards, values, response_mask, *, gamma, lam, config):
        return estimators.gae(rewards, values, response_mask, gamma, config["lam"] / 2)

    @isolated_registry.register_estimator("td_quarter", uses_lam=True)
    def td_quarter(rewards, values, response_mask, *, gamma, lam, config):
        return estimators.gae(rewards, values, response_mask, gamma, 0.25)

    for name in ("td_lam", "td_configured", "td_quarter"):
        entry = isolated_registry.get(name)
        assert entry.describe(entry.settings({"gamma": 0.9, "lam": 0.5})) == f"{name}(γ=0.9, λ=0.5)"


def test_compare_gives_nstep_its_n_gae_ext_each_lambda_and_the_others_their_defaults():
    assert compared_settings(registry.get("nstep"), 3, (0.9, 1.0)) == ({"n_step": 3},)
    assert compared_settings(registry.get("gae_ext"), 3, (0.9, 1.0)) == ({"lam": 0.9}, {"lam": 1.0})
    assert compared_settings(registry.get("mc"), 3, (0.9, 1.0)) == ({},)


# --------------------------------------------------------------------------- running an estimator


def test_run_whitens_as_the_settings_say_unless_told_otherwise():
    """mc, γ = 0.5, rewards (1, 2, 4), values 1: G = (1 + 1 + 1, 2 + 2, 4) = (3, 4, 4), raw = G − V =
    (2, 3, 3); whitened: mean 8/3, unbiased variance ((2/3)² + 2 (1/3)²) / 2 = 1/3, so (−2, 1, 1)/√3."""
    rewards, values, mask = torch.tensor([[1.0, 2.0, 4.0]]), torch.ones(1, 3), torch.ones(1, 3, dtype=torch.int64)
    entry = registry.get("mc")
    plain = registry.run(entry, rewards, values, mask, entry.settings({"gamma": 0.5, "whiten_advantages": False}))
    torch.testing.assert_close(plain.returns, torch.tensor([[3.0, 4.0, 4.0]]))
    torch.testing.assert_close(plain.advantage_raw, torch.tensor([[2.0, 3.0, 3.0]]))
    torch.testing.assert_close(plain.advantages, torch.tensor([[2.0, 3.0, 3.0]]))  # not whitened
    whitened = registry.run(entry, rewards, values, mask, entry.settings({"gamma": 0.5, "whiten_advantages": False}), whiten=True)
    torch.testing.assert_close(whitened.advantages, torch.tensor([[-2.0, 1.0, 1.0]]) / 3**0.5)


def test_run_refuses_missing_values_and_outputs_of_the_wrong_shape(isolated_registry):
    rewards, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.int64)
    td0 = isolated_registry.get("td0")
    with pytest.raises(ValueError, match="estimator 'td0' needs the critic's values, and there are none"):
        isolated_registry.run(td0, rewards, None, mask, td0.settings({}))

    @isolated_registry.register_estimator("short", needs_critic=False)
    def short(rewards, values, response_mask, *, gamma, lam, config):
        return rewards[:, :2], rewards

    entry = isolated_registry.get("short")
    with pytest.raises(ValueError, match=r"estimator 'short' returned returns of shape \(2, 2\), expected \(2, 3\)"):
        isolated_registry.run(entry, rewards, None, mask, entry.settings({}))
