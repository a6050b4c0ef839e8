"""verl's real RayPPOTrainer.fit() on CPU, in-process, for every estimator (verl-ext's four, verl's gae
and grpo, and the README's example of a user's estimator, loaded through VERL_USE_EXTERNAL_MODULES),
with KL in the reward and the per-token trace on, its update tables included: two PPO epochs of two
shuffled mini-batches of two micro-batches each, a large actor learning rate and a small clip ratio,
so that ratios move away from 1 and clipping happens; verl's gae with the batch settings of GPU
runs (micro-batches packed by token count, no batch balancing); and ``turn_gae`` on
multi-turn responses (an agent loop that puts an observation the policy did not write between two
assistant turns: holes in the mask, as verl's tool agent loop makes). One fresh interpreter per
scenario (the platform, registries and patches are process-global).

What each run is checked against, independently of verl-ext's own code:
* the batch the trainer actually used at each step, copied by the runner's ``on_batch`` hook;
* returns and advantages recomputed from that batch with tests/support/reference.py (direct sums);
* rewards = scores − β·kl with kl from verl's own ``core_algos.kl_penalty``;
* the trace read back from disk equals that batch; the run record matches the config;
* ``verl-ext check`` passes on the trace;
* verl's logged live metrics (``verl_ext/…``) equal the same quantities computed from the trace.

Covers: the legacy trainer's seam and hooks (verl_ext.integration: plugin, patches, validation,
trace_hook, update_hook, metrics_hook), verl_ext.registry, verl_ext.estimators and verl_ext.kernels
(turn_gae through verl_ext.turns), verl_ext.trace (capture, writer, reader), verl_ext.step_metrics,
verl_ext.inspect (check, critic, summary), the ``check`` command of verl_ext.cli and the CPU backend's
in-process runner (verl_ext.cpu).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tests.support.reference as ref
from tests.cpu.helpers import SCENARIOS, VERL_BATCH_KEYS, read_batches, run
from tests.support import tolerances
from tests.support.tolerances import assert_within
from tests.support.shared_runs import shared_run

ROOT = Path(__file__).resolve().parents[2]
GAMMA, LAM = 0.99, 0.9

#: sequences (prompt and response) per micro-batch without dynamic_bsz: UPDATE_OVERRIDES' actor, the
#: CPU recipe's critic; and the token budgets of the dynamic_bsz run (a sequence is ~20 tokens)
FIXED_MICRO_BATCH = {"actor": 2, "critic": 4}
TOKEN_BUDGET = {"actor": 32, "critic": 40}
MULTI_TURN = "turn_gae+observation"
#: data.max_response_length of the runs that cut responses (docs/definitions.md #truncated-responses): the
#: task's answer is 7 tokens and EOS for a one-digit sum, 8 and EOS for a two-digit one, so 8 cuts the
#: two-digit ones before their EOS; and algorithm.truncation of those runs, by estimator
CUT_AT = 8
TRUNCATION = {"nstep": "bootstrap", "gae": "mask", "grpo": "mask"}


def cut_at_the_limit(estimator: str) -> list[str]:
    return [f"algorithm.truncation={TRUNCATION[estimator]}", f"data.max_response_length={CUT_AT}"]


#: verl's rollout correction (docs/definitions.md#off-policy-tokens) on the td0 run: token-level weights
#: truncated at 2, and token_k1 rejection of every token whose ratio π_old/π_rollout is off 1 by more than
#: 5e-7 (an fp32 trainer and the HF-generate rollout disagree by up to a few 1e-6 on some tokens)
REJECTION_THRESHOLD = "0.9999995_1.0000005"
CORRECTION = [
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=2.0",
    "algorithm.rollout_correction.rollout_rs=token_k1",
    f"algorithm.rollout_correction.rollout_rs_threshold='{REJECTION_THRESHOLD}'",
]
#: verl's bypass mode on the gae_ext run: π_old := π_rollout, the loss PPO's clipped one (loss_type ppo_clip)
BYPASS = ["algorithm.rollout_correction.bypass_mode=True", "algorithm.rollout_correction.loss_type=ppo_clip"]
#: scenario -> (estimator, its overrides)
#: verl saves a checkpoint after every step of the runs ``verl-ext replay`` replays with the model
#: (tests/e2e/test_replay.py), in the CPU recipe's trainer.default_local_dir (16 MB and well under a
#: second of the run's 11-12 s for a run of two steps, measured on td0's)
CHECKPOINTS = "trainer.save_freq=1"
RUNS = {
    "mc": ("mc", [CHECKPOINTS]),
    "td0": ("td0", [*CORRECTION, CHECKPOINTS]),
    # V(s_L) kept from the critic, checked against a separate forward pass (test_bootstrap_value_...)
    "nstep": ("nstep", ["algorithm.n_step=3", *cut_at_the_limit("nstep")]),
    # in verl's bypass mode (docs/definitions.md#off-policy-tokens): old log-probs = the rollout's, vanilla PPO's loss
    "gae_ext": ("gae_ext", ["algorithm.lam_critic=1.0", "algorithm.lam_actor=0.8", *BYPASS]),
    # verl's gae with the batch settings of GPU runs: micro-batches packed by token count (actor,
    # critic and every log-prob and value pass; verl reorders the rows and restores them after), and
    # no balancing; the other runs have verl's default, trainer.balance_batch=True (it reorders the batch)
    "gae+dynamic_bsz": ("gae", [
        "actor_rollout_ref.actor.use_dynamic_bsz=True",  # the critic, log-prob and ref passes follow it
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={TOKEN_BUDGET['actor']}",
        f"critic.ppo_max_token_len_per_gpu={TOKEN_BUDGET['critic']}",
        "trainer.balance_batch=False",
        CHECKPOINTS,
        *cut_at_the_limit("gae"),  # verl's own gae with the cut responses left out of the whitening
    ]),
    "grpo": ("grpo", [*cut_at_the_limit("grpo"), CHECKPOINTS]),  # the cut responses dropped from their groups
    "td_half": ("td_half", []),  # the README's example, tests/integration/test_user_estimator.py
    # multi-turn responses through verl's agent-loop worker: the policy writes, an observation it did
    # not write follows (mask 0), the policy writes on (tests/cpu/observation_agent.py)
    MULTI_TURN: ("turn_gae", ["actor_rollout_ref.rollout.agent.default_agent_loop=observation_agent", CHECKPOINTS]),
}
UPDATE_OVERRIDES = [
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.shuffle=True",
    "actor_rollout_ref.actor.optim.lr=1e-2",
    "actor_rollout_ref.actor.clip_ratio=0.1",
    "actor_rollout_ref.actor.calculate_entropy=True",
]


def user_module_env(out: Path) -> dict[str, str]:
    """The README's example estimator as a module on PYTHONPATH, loaded by verl in every process."""
    from tests.integration.test_user_estimator import readme_example

    (out / "user").mkdir(exist_ok=True)
    (out / "user" / "my_estimators.py").write_text(readme_example())
    return {"PYTHONPATH": f"{out / 'user'}:{ROOT}", "VERL_USE_EXTERNAL_MODULES": "my_estimators"}


def scenario(tmp_path_factory, estimator: str, extra: list[str], rollout_n: int = 1, steps: int = 2) -> Path:
    """The in-process run of ``estimator`` with these settings, made once per test session
    (tests/support/shared_runs.py): every test that needs the same run reads it."""
    overrides = [
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_ctrl.kl_coef=0.05",
        f"algorithm.gamma={GAMMA}",
        f"algorithm.lam={LAM}",
        *UPDATE_OVERRIDES,
        *extra,
    ]

    def make(out: Path) -> None:
        command = [
            sys.executable, str(SCENARIOS), "in-process", str(out), "--estimator", estimator, "--steps", str(steps),
            "--rollout-n", str(rollout_n), "--config-dir", str(ROOT / "verl_ext" / "configs"),
            "--config-name", "verl_ext_trainer", "--", *overrides, f"verl_ext.trace.dir={out / 'trace'}",
        ]  # fmt: skip
        env = {**os.environ, "VERL_EXT_CPU": "1", **(user_module_env(out) if estimator == "td_half" else {})}
        run(command, env=env, cwd=out, timeout=600)

    return shared_run(tmp_path_factory, ["fit_with_trace", estimator, overrides, rollout_n, steps], make)


def fit_run(tmp_path_factory, name: str) -> Path:
    """The output directory of the run ``RUNS[name]`` (made at most once per session)."""
    estimator, overrides = RUNS[name]
    return scenario(tmp_path_factory, estimator, overrides, rollout_n=4 if estimator == "grpo" else 1)


def fit_group(run: str):
    """One pytest-xdist group per verl run of this module (an estimator's, the planted errors' one):
    the run and the tests that read it stay on one worker, and the runs spread over the workers."""
    return pytest.mark.xdist_group(f"fit_with_trace-{run}")


@pytest.fixture(scope="module", params=[pytest.param(name, marks=fit_group(name)) for name in RUNS])
def finished_run(request, tmp_path_factory):
    out = fit_run(tmp_path_factory, request.param)
    return RUNS[request.param][0], out, read_batches(out)


def valid(mask) -> np.ndarray:
    return mask.numpy() != 0


def test_values_are_present_and_the_critic_trains(finished_run):
    from verl_ext.apps.learning import read_metrics

    estimator, out, batches = finished_run
    steps = batches["steps"]
    assert sorted(steps) == [1, 2]
    if estimator == "grpo":
        assert "values" not in steps[1]  # critic-free: verl-ext does not switch the critic on
        return
    for batch in steps.values():
        values = batch["values"].numpy()[valid(batch["response_mask"])]
        assert np.isfinite(values).all() and values.std() > 0
    metrics = read_metrics(out)
    assert all(metrics[step]["critic/grad_norm"] > 0 for step in (1, 2))  # the critic was updated
    assert not np.allclose(steps[1]["values"].numpy(), steps[2]["values"].numpy())


def test_rewards_are_scores_minus_beta_kl(finished_run):
    from verl.trainer.ppo import core_algos

    estimator, _, batches = finished_run
    for step, batch in batches["steps"].items():
        mask = batch["response_mask"]
        if estimator == "td0":  # the KL is applied before verl's rejection: on the policy's own tokens
            mask = batch["attention_mask"][:, -mask.shape[1]:]
        kld = core_algos.kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], kl_penalty="kl") * mask
        expected = batch["token_level_scores"] - 0.05 * kld
        np.testing.assert_allclose(batch["token_level_rewards"].numpy(), expected.numpy(), rtol=1e-6, atol=1e-7)
    # at step 1 the actor is still the reference model (kl = 0); after one update it is not
    last = batches["steps"][2]
    assert not np.allclose(last["token_level_rewards"].numpy(), last["token_level_scores"].numpy())


def test_returns_and_advantages_follow_the_definitions(finished_run):
    estimator, _, batches = finished_run
    if estimator == "grpo":
        pytest.skip("grpo is verl's own critic-free estimator; its trace checks are in test_check_passes")
    cut_counts = []
    for batch in batches["steps"].values():
        rewards, values, mask = batch["token_level_rewards"], batch["values"], batch["response_mask"]
        values64 = values.double().numpy()
        cut = cut_rows(batch, estimator)
        cut_counts.append((int(cut.sum()), len(cut)))
        if estimator == "mc":
            returns = ref.mc_returns(rewards, mask, GAMMA)
            raw = returns - values64
        elif estimator == "td0":
            returns = ref.td0_returns(rewards, values, mask, GAMMA)
            raw = returns - values64
        elif estimator == "nstep":  # bootstraps a cut response from V(s_L)
            v_last = np.where(cut, batch["values_after_last"].double().numpy(), 0.0)
            returns = ref.nstep_returns(rewards, values, mask, GAMMA, 3, v_last)
            raw = returns - values64
        elif estimator == "gae_ext":
            returns = ref.gae_advantages(rewards, values, mask, GAMMA, 1.0) + values64
            raw = ref.gae_advantages(rewards, values, mask, GAMMA, 0.8)
        elif estimator == "td_half":
            raw = ref.gae_advantages(rewards, values, mask, GAMMA, 0.5)
            returns = raw + values64
        elif estimator == "turn_gae":  # one advantage per assistant turn; token-level GAE(λ) returns
            raw = ref.turn_gae_advantages(rewards, values, mask, GAMMA, LAM)
            returns = ref.gae_advantages(rewards, values, mask, GAMMA, LAM) + values64
        else:  # verl's gae
            raw = ref.gae_advantages(rewards, values, mask, GAMMA, LAM)
            returns = raw + values64
        keep = valid(mask)
        # the trainer's float32 against these float64 sums: docs/definitions.md#tolerances (n: the row's length)
        lengths, magnitude = tolerances.per_row(mask, rewards, values, returns, raw)
        assert_within(batch["returns"].numpy()[keep], returns[keep], tolerances.accumulated(returns, lengths, magnitude)[keep], "returns")
        rest = mask.numpy() * ~cut[:, None] if TRUNCATION.get(estimator) == "mask" else mask.numpy()
        if TRUNCATION.get(estimator) == "mask":  # whitened over the rest, 0 on a cut response
            # at lr 1e-2 every response of step 2 may be cut: nothing to whiten
            whitened = np.where(cut[:, None], 0.0, ref.whiten(raw, rest)) if rest.any() else np.zeros_like(raw)
        else:
            whitened = ref.whiten(raw, mask)
        # the raw advantage's own rounding (its sums') whitened, and the whitening's
        raw_error = tolerances.accumulated(raw, lengths, magnitude)
        operands = tolerances.whitening_operands(raw, rest, returns, values64) if rest.sum() > 1 else np.zeros_like(raw)
        sigma = np.sqrt(raw[rest != 0].var(ddof=1) + 1e-8) if rest.sum() > 1 else 1.0
        tolerance = tolerances.whitened(whitened, operands) + raw_error / sigma
        assert_within(batch["advantages"].numpy()[keep], whitened[keep], tolerance[keep], "advantages")
    if estimator in TRUNCATION:  # the run had both kinds of response: step 1 (the starting policy) cuts most, not all
        assert 0 < cut_counts[0][0] < cut_counts[0][1], cut_counts


def cut_rows(batch, estimator: str) -> np.ndarray:
    """(B,) the responses cut at the limit (none where the run sets no truncation), by the definition."""
    if estimator not in TRUNCATION:
        return np.zeros(len(batch["response_mask"]), bool)
    return cut_at_the_limit_rows(batch)


def cut_at_the_limit_rows(batch) -> np.ndarray:
    """(B,) the responses of a batch (``responses``, ``response_mask``) of a run cut at CUT_AT, by the definition."""
    from verl_ext.tasks import get_task

    eos = get_task("arith").tokenizer().eos_token_id
    return ref.cut_rows(batch["responses"], batch["response_mask"], {eos}, CUT_AT)


@pytest.mark.parametrize("finished_run", [pytest.param("nstep", marks=fit_group("nstep"))], indirect=True)
def test_bootstrap_value_is_the_critics_value_after_the_last_token(finished_run):
    """V(s_L) of every response equals a separate forward pass of the critic on the full sequence
    (tests/cpu/scenarios.py ``critic_at_the_end``, before the step's critic update); the trace keeps it as
    ``bootstrap_value`` on exactly the cut responses; some responses are cut and some are not."""
    from verl_ext.trace.reader import open_trace

    estimator, out, batches = finished_run
    trace = open_trace(str(out / "trace"))
    assert trace.record.algorithm["truncation"] == "bootstrap"
    cut_counts = []
    for step, batch in batches["steps"].items():
        np.testing.assert_allclose(
            batch["values_after_last"].numpy(), batch["separate_values_after_last"].numpy(), rtol=1e-5, atol=1e-5
        )
        cut = cut_rows(batch, estimator)
        cut_counts.append(int(cut.sum()))
        prompts = trace.prompts(step).to_pandas()
        assert prompts["truncated"].tolist() == cut.tolist()
        kept = prompts["bootstrap_value"].to_numpy(np.float64)
        assert np.isnan(kept[~cut]).all()
        np.testing.assert_array_equal(kept[cut].astype(np.float32), batch["values_after_last"].numpy()[cut])
    assert 0 < sum(cut_counts) < sum(len(b["response_mask"]) for b in batches["steps"].values()), cut_counts


def test_trace_equals_what_the_trainer_used(finished_run):
    from verl_ext.trace.reader import open_trace

    estimator, out, batches = finished_run
    trace = open_trace(str(out / "trace"))
    assert trace.steps == [1, 2]
    columns = {"score": "token_level_scores", **VERL_BATCH_KEYS}
    for step, batch in batches["steps"].items():
        table = trace.read_step(step).to_pandas()
        mask = batch["response_mask"].numpy()
        # the policy's own tokens: the response mask before verl's rejection (single-turn: the attention's)
        own = batch["attention_mask"][:, -mask.shape[1]:].numpy() if estimator == "td0" else mask
        lengths = [int(np.flatnonzero(row).max()) + 1 if row.any() else 0 for row in own]
        assert len(table) == sum(lengths)
        positions = (table["sample"].to_numpy(), table["token_index"].to_numpy())
        assert (table["mask"].to_numpy() == (mask[positions] != 0)).all()
        if estimator == "td0":
            settings = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1", "rollout_rs_threshold": REJECTION_THRESHOLD}
            assert_the_correction_is_verls(batch, own, table, positions, settings)
        assert (table["token_id"].to_numpy() == batch["responses"].numpy()[positions]).all()
        assert list(table["uid"]) == [batches["steps"][step]["uid"][s] for s in positions[0]]
        for column, key in columns.items():
            if key not in batch:
                assert table[column].isna().all(), column
                continue
            np.testing.assert_array_equal(table[column].to_numpy(np.float32), batch[key].float().numpy()[positions])
        if estimator != "grpo":
            raw = (batch["returns"] - batch["values"]).double().numpy()
            if estimator == "gae_ext":  # decoupled λ: the raw advantage is GAE(λ_actor), not returns − values
                raw = ref.gae_advantages(batch["token_level_rewards"], batch["values"], batch["response_mask"], GAMMA, 0.8)
            if estimator == "turn_gae":
                raw = ref.turn_gae_advantages(batch["token_level_rewards"], batch["values"], batch["response_mask"], GAMMA, LAM)
            valid_rows = table["mask"].to_numpy()  # a hole's numbers are not part of the contract
            # the trainer's float32 raw advantage: its sums' rounding, and one subtraction (docs/definitions.md#tolerances)
            returns, values = batch["returns"].double().numpy(), batch["values"].double().numpy()
            lengths, magnitude = tolerances.per_row(batch["response_mask"], batch["token_level_rewards"], values, returns, raw)
            bound = tolerances.accumulated(raw, lengths, magnitude) + 4 * tolerances.EPS32 * (np.abs(returns) + np.abs(values))
            assert_within(table["advantage_raw"].to_numpy()[valid_rows], raw[positions][valid_rows], bound[positions][valid_rows], "advantage_raw")
        assert trace.step_record(step).kl_coef == pytest.approx(0.05)


def assert_the_correction_is_verls(batch, own, table, positions, settings: dict) -> None:
    """The trace's rejected tokens are the policy's tokens (``own``: the response mask before the rejection) the
    batch's mask lacks, and verl's own correction (``settings``: its compute_rollout_correction_and_rejection_mask's
    keyword arguments) of them from the recorded log-probs gives that mask and the batch's weights; a rejection is
    no turn boundary: each token's turn counts the turns of the policy's tokens (maximal runs of ``own``: one for a
    single-turn response), its role is the assistant's on them and the tool's in a hole between two."""
    import torch
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    mask = batch["response_mask"].numpy()
    rejected = (own != 0) & (mask == 0)
    assert (table["rejected"].to_numpy(bool) == rejected[positions]).all()
    old, rollout = batch["old_log_probs"], batch["rollout_log_probs"]
    weights, kept, _ = compute_rollout_correction_and_rejection_mask(old, rollout, torch.from_numpy(own), **settings)
    np.testing.assert_array_equal(kept.numpy(), mask)
    if weights is not None:  # the trace's column is held to the batch's with the other columns
        np.testing.assert_array_equal(weights.batch["rollout_is_weights"].numpy(), batch["rollout_is_weights"].numpy())
    turn, role = np.full(own.shape, -1), np.where(own != 0, "assistant", "tool")
    for row, mask_row in enumerate(own):
        for k, positions_of_turn in enumerate(ref.turns_of_row(mask_row)):
            turn[row, positions_of_turn[0]:] = k  # a hole keeps the turn before it
    assert (table["turn"].to_numpy() == turn[positions]).all() and (table["role"].to_numpy() == role[positions]).all()


def test_run_record_matches_the_config(finished_run):
    from verl_ext.trace.reader import open_trace

    estimator, out, _ = finished_run
    record = open_trace(str(out / "trace")).record
    algorithm = record.algorithm
    assert record.trainer == "legacy"
    assert algorithm["adv_estimator"] == estimator
    assert (algorithm["gamma"], algorithm["lam"]) == (GAMMA, LAM)
    assert algorithm["use_kl_in_reward"] is True and algorithm["kl_ctrl"]["kl_coef"] == 0.05
    if estimator == "nstep":
        assert algorithm["n_step"] == 3
    if estimator == "gae_ext":
        assert (algorithm["lam_critic"], algorithm["lam_actor"]) == (1.0, 0.8)
    if estimator == "td_half":
        assert algorithm["estimator_module"] == "my_estimators"
    if estimator == "gae_ext":
        assert algorithm["rollout_correction"]["bypass_mode"] is True
    elif estimator == "td0":
        correction = algorithm["rollout_correction"]
        assert (correction["rollout_is"], correction["is_upper"]) == ("token", 2.0)
        assert [option["name"] for option in correction["rejection"]] == ["token_k1"]
    else:
        assert algorithm["rollout_correction"] is None
    assert Path(record.model_path).is_dir()


def test_check_passes(finished_run):
    estimator, out, _ = finished_run
    env = {**os.environ, **(user_module_env(out) if estimator == "td_half" else {})}
    result = subprocess.run(
        [sys.executable, "-m", "verl_ext.cli", "check", str(out / "trace"), "--json"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["passed"] is True
    statuses = {identity["identity"]: identity["status"] for identity in report["identities"]}
    recomputed = "skipped" if estimator == "grpo" else "pass"  # grpo's advantages are group statistics
    assert statuses["returns"] == statuses["advantage_raw"] == recomputed
    update = {"update_rows", "ratio", "ratio_first", "pg_loss", "clip", "update_metrics"}
    assert {statuses[key] for key in update} == {"pass"}
    correction = {"is_weights", "rejection"}
    assert {statuses.get(key) for key in correction} == ({"pass"} if estimator == "td0" else {None})
    assert statuses.get("bypass") == ("pass" if estimator == "gae_ext" else None)  # old = rollout, bit for bit
    assert statuses["vf_loss"] == ("skipped" if estimator == "grpo" else "pass")
    if estimator != "td_half":
        return
    # where its module does not import, the same run is never PASS: its estimator is not checked (exit 3)
    env = {key: value for key, value in os.environ.items() if key != "VERL_USE_EXTERNAL_MODULES"}
    result = subprocess.run(
        [sys.executable, "-m", "verl_ext.cli", "check", str(out / "trace"), "--json"],
        capture_output=True, text=True, env=env, cwd=out,
    )  # fmt: skip
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["verdict"] == "incomplete" and report["passed"] is False
    assert [entry["identities"] for entry in report["not_checked"]] == [["advantage_raw", "returns"]]
    assert "No module named 'my_estimators'" in report["not_checked"][0]["reason"]
    unchecked = {identity["identity"]: identity["status"] for identity in report["identities"]}
    assert {key: unchecked[key] for key in unchecked if key not in ("advantage_raw", "returns")} == {
        key: statuses[key] for key in statuses if key not in ("advantage_raw", "returns")
    }


def assert_live_metrics_equal_the_trace(out: Path, estimator: str) -> None:
    """verl's metrics of every traced step hold the live metrics (docs/definitions.md §9), equal to
    the post-hoc numbers of the trace: :func:`traced_step_metrics` (G recomputed in float64 from the
    recorded rewards), and the columns of ``summary`` and ``summary --critic`` that are the same
    quantities; to float32 rounding (the trainer computed from float32 tensors)."""
    from verl_ext.apps.learning import read_metrics
    from verl_ext.inspect.critic import critic_diagnostics, traced_step_metrics
    from verl_ext.inspect.summary import summarize
    from verl_ext.trace.reader import open_trace

    trace, metrics = open_trace(str(out / "trace")), read_metrics(out)
    summary = {row["step"]: row for row in summarize(trace).to_pylist()}
    critic = {} if estimator == "grpo" else {(r["step"], r["bucket"]): r for r in critic_diagnostics(trace).to_pylist()}
    close = dict(rel=1e-4, abs=1e-5)
    for step in trace.steps:
        live = {key.removeprefix("verl_ext/"): value for key, value in metrics[step].items() if key.startswith("verl_ext/")}
        # the per-turn rewards' (verl_ext.turn_rewards, where the run turns them on): what the trace placed, per
        # response, every one of them placed
        placed = {key: live.pop(key) for key in [key for key in live if key.startswith("turn_rewards/")]}
        if placed:
            table, responses = trace.read_step(step, ["turn_score", "tool_reward"]).to_pandas(), trace.prompts(step).num_rows
            expected = {f"turn_rewards/{name}": table[name].sum() / responses for name in ("turn_score", "tool_reward")}
            assert placed == pytest.approx({**expected, "turn_rewards/unplaced": 0.0}, **close), step
        posthoc = traced_step_metrics(trace, step)
        assert sorted(live) == sorted(posthoc), step
        for key, value in posthoc.items():
            assert live[key] == pytest.approx(value, **close), (step, key)
        row = summary[step]
        raw_std = row["adv_raw_std"] if row["adv_raw_std"] is not None else row["adv_std"]  # grpo: no raw advantage
        assert (live["adv/raw_std"], live["adv/whiten_mean"], live["adv/whiten_std"]) == pytest.approx(
            (raw_std, row["adv_mean"], row["adv_std"]), **close
        )
        # with several responses per prompt (grpo's run here, 4; the V1 run's too, 4): a prompt's uid repeats
        groups = trace.prompts(step).column("uid").to_pandas().duplicated().any()
        assert ("reward/group_std" in live) == groups
        if estimator == "grpo":
            assert "critic/ev_mc" not in live
            continue
        # an explained variance needs 8 tokens (docs/definitions.md §9): left out of both where a step has fewer
        # (the V1 run's rejection can take out whole responses, and their last tokens)
        pairs = [("critic/ev_mc", row["ev_mc"]), ("critic/ev_mc_last", row["ev_mc_last"])]
        pairs += [(f"critic/ev_mc/d{decile}", critic[(step, f"d{decile}")]["explained_var"]) for decile in range(10)]
        for key, ev in pairs:
            assert live.get(key) == (None if ev is None else pytest.approx(ev, **close)), (step, key)


def test_live_metrics_equal_the_traces_numbers(finished_run):
    estimator, out, _ = finished_run
    assert_live_metrics_equal_the_trace(out, estimator)


# --------------------------------------------------------------------------- the update tables


def trained_tokens(batch) -> set[tuple[int, int]]:
    """(sample, token_index) of every valid token of the batch the trainer used (the recorder's copy)."""
    return {(int(i), int(t)) for i, t in np.argwhere(batch["response_mask"].numpy() != 0)}


def test_update_rows_cover_every_trained_token_once_per_epoch(finished_run):
    from verl_ext.trace.reader import open_trace

    estimator, out, batches = finished_run
    trace = open_trace(str(out / "trace"))
    kinds = ["actor"] + ([] if estimator == "grpo" else ["critic"])
    assert trace.update_steps == {"actor": [1, 2], "critic": [1, 2] if "critic" in kinds else []}
    for step, batch in batches["steps"].items():
        expected = trained_tokens(batch)
        for kind in kinds:
            table = (trace.actor_update if kind == "actor" else trace.critic_update)(step).to_pandas()
            assert sorted(table["epoch"].unique()) == [0, 1]
            for _, rows in table.groupby("epoch"):
                keys = list(zip(rows["sample"], rows["token_index"]))
                assert len(keys) == len(set(keys)) and set(keys) == expected, kind
                assert sorted(rows["minibatch"].unique()) == [0, 1]
        actor = trace.actor_update(step).to_pandas()
        positions = (actor["sample"].to_numpy(), actor["token_index"].to_numpy())
        np.testing.assert_array_equal(actor["advantage"].to_numpy(np.float32), batch["advantages"].numpy()[positions])
        np.testing.assert_array_equal(actor["old_log_prob"].to_numpy(np.float32), batch["old_log_probs"].numpy()[positions])
        assert actor["entropy"].notna().all()


@pytest.mark.parametrize("finished_run", [pytest.param(MULTI_TURN, marks=fit_group(MULTI_TURN))], indirect=True)
def test_the_observation_agent_gives_multi_turn_responses_and_metrics_by_turn(finished_run):
    """The multi-turn run is one: responses of two assistant turns around an observation the update
    does not train (the update tables above hold the valid tokens only), their turns in the trace,
    and the live metrics by turn in verl's metrics (equal to the trace's numbers, above)."""
    from verl_ext.apps.learning import read_metrics
    from verl_ext.trace.reader import open_trace

    _, out, batches = finished_run
    trace = open_trace(str(out / "trace"))
    for step, batch in batches["steps"].items():
        turns = trace.prompts(step)["assistant_turns"].to_numpy()
        expected = [len(ref.turns_of_row(row)) for row in batch["response_mask"].numpy()]
        assert turns.tolist() == expected and (turns == 2).sum() >= len(turns) // 2, turns
        table = trace.read_step(step, ["sample", "token_index", "mask", "turn"]).to_pandas()
        holes = table[~table["mask"]]
        assert len(holes) and (holes["turn"] == 0).all()  # a hole keeps the turn before it
        assert set(table["turn"]) == {0, 1}
        metrics = read_metrics(out)[step]
        assert {"verl_ext/critic/ev_mc/turn1", "verl_ext/credit/share/turn1"} <= set(metrics)
        assert metrics["verl_ext/credit/share/turn0"] + metrics["verl_ext/credit/share/turn1"] == pytest.approx(1.0)


def test_the_batch_settings_took_effect(finished_run, request):
    """The tests above show that the rows join exactly either way. Fixed micro-batches are of one
    size; under use_dynamic_bsz, of at most the token budget (verl's max sum of attention_mask per
    micro-batch). verl logs global_seqlen/* when it balanced (reordered) the batch."""
    from verl_ext.apps.learning import read_metrics
    from verl_ext.trace.reader import open_trace

    estimator, out, batches = finished_run
    trace = open_trace(str(out / "trace"))
    dynamic = "dynamic_bsz" in request.node.callspec.params["finished_run"]
    for kind in ["actor"] + ([] if estimator == "grpo" else ["critic"]):
        sizes = []
        for step in trace.steps:
            sequence_lengths = batches["steps"][step]["attention_mask"].sum(-1).numpy()
            table = trace.update_table(kind, step).to_pandas()
            samples = table.groupby(["epoch", "minibatch", "microbatch"])["sample"].unique()
            sizes += [len(rows) for rows in samples]
            if dynamic:
                assert max(sequence_lengths[rows].sum() for rows in samples) <= TOKEN_BUDGET[kind], kind
        if estimator == "td0":  # a sample whose tokens verl's rejection took out trains no row: fewer
            assert max(sizes) == FIXED_MICRO_BATCH[kind] and min(sizes) >= 1, (kind, sizes)
            continue
        assert (set(sizes) == {FIXED_MICRO_BATCH[kind]}) != dynamic, (kind, sizes)
    trained = [metrics for metrics in read_metrics(out).values() if "critic/score/mean" in metrics]
    assert len(trained) == 2 and all(("global_seqlen/min" in metrics) != dynamic for metrics in trained)


def test_the_update_moves_ratios_and_clips(finished_run):
    from verl_ext.trace.reader import open_trace

    _, out, _ = finished_run
    trace = open_trace(str(out / "trace"))
    actor = pd_concat(trace.actor_update(step).to_pandas() for step in trace.steps)
    first = actor[(actor.epoch == 0) & (actor.minibatch == 0)]
    assert np.abs(first["ratio"] - 1).max() < 1e-5  # fp32 on CPU: the policy that produced old_log_prob
    later = actor[(actor.epoch == 1)]
    assert np.abs(later["ratio"] - 1).max() > 0.05
    # clipping happens; which side depends on the estimator: the warm start's tokens are mostly
    # near-certain, and a token of probability p cannot reach a ratio above 1/p
    assert set(actor["clip"]) & {"low", "high", "dual"}


def pd_concat(frames):
    import pandas as pd

    return pd.concat(list(frames))


def test_update_reproduces_verls_logged_metrics(finished_run):
    """verl's own metrics file against the update tables, aggregated here as verl's token-mean does:
    per mini-batch over its tokens, then the mean over mini-batches and epochs; clip fractions as
    means of micro-batch fractions."""
    from verl_ext.apps.learning import read_metrics
    from verl_ext.trace.reader import open_trace

    estimator, out, _ = finished_run
    trace, metrics = open_trace(str(out / "trace")), read_metrics(out)
    for step in trace.steps:
        actor = trace.actor_update(step).to_pandas()
        per_minibatch = actor.groupby(["epoch", "minibatch"])
        # verl's float32 aggregate of n terms: 1e-6 + ε·n·max|term|, n the largest mini-batch's tokens (docs/definitions.md#tolerances)
        largest = per_minibatch.size().max()
        aggregate = lambda terms: tolerances.ATOL + tolerances.EPS32 * largest * terms.abs().max()  # noqa: E731
        assert abs(per_minibatch["pg_loss"].mean().mean() - metrics[step]["actor/pg_loss"]) < aggregate(actor["pg_loss"])
        clipped = actor.assign(clipped=actor["clip"].isin(["low", "high"]))
        micro = clipped.groupby(["epoch", "minibatch", "microbatch"])["clipped"].mean()
        assert micro.groupby(["epoch", "minibatch"]).mean().mean() == pytest.approx(metrics[step]["actor/pg_clipfrac"], abs=1e-6)
        if estimator == "grpo":
            continue
        critic = trace.critic_update(step).to_pandas()
        vf = 0.5 * critic.groupby(["epoch", "minibatch"])["vf_loss"].mean().mean()
        largest = critic.groupby(["epoch", "minibatch"]).size().max()
        assert abs(vf - metrics[step]["critic/vf_loss"]) < tolerances.ATOL + tolerances.EPS32 * largest * critic["vf_loss"].abs().max()
        fractions = critic.groupby(["epoch", "minibatch", "microbatch"])["vf_clipped"].mean()
        assert fractions.mean() == pytest.approx(metrics[step]["critic/vf_clipfrac"], abs=1e-6)


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory):
    """The mc run's trace: the planted errors go into its step 1, and only step 1 is checked."""
    return fit_run(tmp_path_factory, "mc") / "trace"


PLANTS = {  # column of an update table -> the identity that must catch a change of it
    ("actor", "log_prob"): "ratio",
    ("actor", "ratio"): "ratio",
    ("actor", "old_log_prob"): "update_rows",
    ("actor", "advantage"): "update_rows",
    ("actor", "pg_loss"): "pg_loss",
    ("actor", "clip"): "clip",
    ("actor", "sample"): "update_rows",
    ("actor", "epoch"): "update_rows",
    ("critic", "vpred"): "vf_loss",
    ("critic", "vpred_clipped"): "vf_loss",
    ("critic", "vf_loss"): "vf_loss",
    ("critic", "vf_clipped"): "vf_loss",
    ("critic", "value"): "update_rows",
    ("critic", "return"): "update_rows",
    ("critic", "token_index"): "update_rows",
}


@fit_group("mc")  # on the worker that makes the mc run
@pytest.mark.parametrize("plant", PLANTS, ids=lambda p: f"{p[0]}.{p[1]}")
def test_a_planted_error_in_each_update_column_is_caught(one_step_run, tmp_path, plant):
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_ext.check.run import check_trace
    from verl_ext.trace.schema import update_file

    kind, column = plant
    trace = tmp_path / "trace"
    shutil.copytree(one_step_run, trace)
    path = trace / update_file(kind, 1)
    table = pq.read_table(path)
    values = table[column].to_pylist()
    rows = range(len(values))
    if plant == ("critic", "vpred"):
        # where the clip is active, vf_loss reads the clip bound, not vpred: a change of vpred there is
        # invisible by definition (the run's samples differ from run to run, and CI once planted on such a row)
        rows = [i for i, clipped in enumerate(table["vpred_clipped"].to_pylist()) if clipped == values[i]]
    row = rows[len(rows) // 2]
    if column == "clip":
        values[row] = "dual" if values[row] != "dual" else "none"
    elif isinstance(values[row], bool):
        values[row] = not values[row]
    elif isinstance(values[row], int):
        values[row] = values[row] + 7
    elif column == "log_prob":
        # the ratio's tolerance is 4ε of the ratio in the loss's dtype (about 3% in bf16), and a fresh clone's
        # run once planted 1% on a log-prob that stayed inside it: the log-prob moves by 0.1 (the ratio by 10%)
        values[row] = values[row] + 0.1
    else:
        values[row] = values[row] * 1.01 + (0.01 if abs(values[row]) < 1e-3 else 0.0)
    table = table.set_column(table.schema.get_field_index(column), column, pa.array(values, table[column].type))
    pq.write_table(table, path)
    report = check_trace(str(trace), steps=[1])
    failed = {r.identity for r in report.identities if r.status == "fail"}
    assert PLANTS[plant] in failed, (failed, [str(r.first) for r in report.identities if r.first])
