"""The checker passes traces whose numbers come from the definitions (direct sums) or from verl's own
functions, and catches a single token changed by 1e-2 relative in each identity, naming its place; a
step of the run record missing on disk fails it."""

import json
import shutil
import sys
from dataclasses import replace

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

import tests.support.reference as ref
from tests.inspect.inspect_helpers import (
    algorithm,
    by_definition,
    by_verl_gae,
    nudge,
    random_batch,
    rewrite_step,
    valid_positions,
    write_trace,
)

from verl_ext import registry
from verl_ext.check.identities import IDENTITIES as RECORDS
from verl_ext.check.run import check_trace
from verl_ext.trace.schema import STEP_RECORD_METADATA_KEY, TOKEN_SCHEMA, token_file

#: Every run's identities without update tables (those of algorithm.truncation apply to its runs only)
IDENTITIES = tuple(record.name for record in RECORDS if record.table != "update" and record.applies is None)

# (estimator name, extra record keys, by_definition arguments)
DEFINED = {
    "mc": ("mc", {}, dict(name="mc", gamma=1.0)),
    "mc-discounted": ("mc", {"gamma": 0.9}, dict(name="mc", gamma=0.9)),
    "td0": ("td0", {"gamma": 0.99}, dict(name="td0", gamma=0.99)),
    "nstep-3": ("nstep", {"n_step": 3}, dict(name="nstep", gamma=1.0, n=3)),
    "nstep-long": ("nstep", {"n_step": 100, "gamma": 0.95}, dict(name="nstep", gamma=0.95, n=100)),
    "gae_ext": ("gae_ext", {"lam": 0.95}, dict(name="gae_ext", gamma=1.0, lam=0.95)),
    "gae_ext-decoupled": (
        "gae_ext", {"lam_critic": 1.0, "lam_actor": 0.9}, dict(name="gae_ext", gamma=1.0, lam=1.0, lam_actor=0.9),
    ),
    "gae_ext-length-adaptive": (
        "gae_ext", {"lam_length_alpha": 0.5, "gamma": 0.99}, dict(name="gae_ext", gamma=0.99, lam=1.0, alpha=0.5),
    ),
    "mc-not-whitened": ("mc", {"whiten_advantages": False}, dict(name="mc", gamma=1.0, whitened=False)),
    "turn_gae": ("turn_gae", {"lam": 0.9, "gamma": 0.97}, dict(name="turn_gae", gamma=0.97, lam=0.9)),
    "turn_gae-critic-lambda": (
        "turn_gae", {"lam_critic": 0.5, "gamma": 0.99}, dict(name="turn_gae", gamma=0.99, lam=1.0, lam_critic=0.5),
    ),
}  # fmt: skip


#: The cases whose traces carry per-turn rewards (verl_ext.turn_rewards).
WITH_TURN_REWARDS = ("td0", "turn_gae")


def defined_trace(tmp_path, case: str, kl_coef: float | None = 0.05, **write) -> str:
    name, extra, args = DEFINED[case]
    algo = algorithm(name, kl="low_var_kl" if kl_coef is not None else None, **extra)
    turn_rewards = case in WITH_TURN_REWARDS
    batches = {step: by_definition(random_batch(step, kl_coef=kl_coef, turn_rewards=turn_rewards), **args) for step in (1, 2)}
    return write_trace(tmp_path / "trace", algo, batches, **write)


def statuses(report) -> dict[str, str]:
    return {r.identity: r.status for r in report.identities}


@pytest.mark.parametrize("case", DEFINED)
def test_passes_traces_built_from_the_definitions(tmp_path, case):
    report = check_trace(defined_trace(tmp_path, case))
    expected = {key: "pass" for key in IDENTITIES}
    if case == "mc-not-whitened":
        expected["whitening_stats"] = "skipped"
    if case not in WITH_TURN_REWARDS:
        expected["turn_rewards"] = "skipped"
    assert statuses(report) == expected, [str(r.first) for r in report.identities if r.first]
    assert report.passed
    assert report.tokens == sum(int(random_batch(s).mask.sum()) for s in (1, 2))


def test_passes_verl_gae_with_kl_interior_masks_padding_and_turn_rewards(tmp_path):
    batches = {step: by_verl_gae(random_batch(step, kl_coef=0.02, turn_rewards=True), gamma=0.99, lam=0.95) for step in (1, 2, 3)}
    path = write_trace(tmp_path / "t", algorithm("gae", gamma=0.99, lam=0.95, kl="kl"), batches)
    report = check_trace(path)
    assert statuses(report) == {key: "pass" for key in IDENTITIES}
    assert report["rewards"].notes == ("all steps: β = 0.02",)


@pytest.mark.parametrize("name", ["mc", "td0", "nstep", "gae_ext", "turn_gae"])
def test_passes_what_verl_ext_estimators_produce_in_float32(tmp_path, name):
    """The production path: verl-ext's float32 estimators (blocked scan) must not trip the tolerances."""
    estimator = registry.get(name)
    settings = estimator.settings({"gamma": 0.99, "lam": 0.9, "n_step": 4 if name == "nstep" else None})
    batches = {}
    for step in (1, 2):
        b = random_batch(step, B=8, T=300)
        result = registry.run(estimator, b.rewards, b.values, b.mask, settings)
        batches[step] = replace(
            b, returns=result.returns, advantages=result.advantages, advantage_raw=result.advantage_raw
        )
    extra = {"n_step": 4} if name == "nstep" else {}
    report = check_trace(write_trace(tmp_path / "t", algorithm(name, gamma=0.99, lam=0.9, **extra), batches))
    assert report.passed, [str(r.first) for r in report.identities if r.first]


def test_passes_turn_gae_with_several_turns_a_response(tmp_path):
    """Up to five turns a response, from the direct sums and from the float32 production path; then a
    raw advantage that is returns − values (a token-level one) fails: the checker recomputes A_k."""
    algo = algorithm("turn_gae", gamma=0.95, lam=0.8, kl="kl")
    defined = {step: by_definition(random_batch(step, T=40, kl_coef=0.1, holes=4), "turn_gae", 0.95, lam=0.8) for step in (1, 2)}
    assert max(len(ref.turns_of_row(row)) for row in defined[1].mask.tolist()) >= 4
    report = check_trace(write_trace(tmp_path / "defined", algo, defined))
    assert report.passed and report["turns"].status == "pass"
    estimator = registry.get("turn_gae")
    settings = estimator.settings({"gamma": 0.95, "lam": 0.8})
    produced = {}
    for step, b in defined.items():
        result = registry.run(estimator, b.rewards, b.values, b.mask, settings)
        produced[step] = replace(b, returns=result.returns, advantages=result.advantages, advantage_raw=result.advantage_raw)
    assert check_trace(write_trace(tmp_path / "produced", algo, produced)).passed
    token_level = {step: by_definition(b, "gae_ext", 0.95, lam=0.8) for step, b in defined.items()}
    report = check_trace(write_trace(tmp_path / "token-level", algo, token_level))
    assert report["advantage_raw"].status == "fail" and report["returns"].status == "pass"


def test_long_rows_pass_and_a_planted_change_is_still_caught(tmp_path):
    """Constant per-token rewards over 4096 tokens make verl's float32 loop drift the most (errors
    grow linearly): the tolerance must absorb that and still see a 1e-2 relative change."""
    T = 4096
    b = random_batch(0, B=2, T=T, interior=False)
    mask = torch.ones(2, T)
    rewards = torch.full((2, T), -0.0013)
    rewards[:, -1] = 1.0
    values = torch.linspace(0, 1, T).repeat(2, 1).to(torch.bfloat16).float()
    b = by_verl_gae(replace(b, mask=mask, scores=rewards, rewards=rewards, values=values), gamma=1.0, lam=1.0)
    clean = {1: b}
    planted = {1: replace(b, returns=b.returns.clone())}
    nudge(planted[1].returns, 1, 2000)
    assert check_trace(write_trace(tmp_path / "clean", algorithm("gae"), clean)).passed
    report = check_trace(write_trace(tmp_path / "planted", algorithm("gae"), planted))
    assert report["returns"].status == "fail"
    assert (report["returns"].first.location.sample, report["returns"].first.location.token_index) == (1, 2000)


# -------------------------------------------------------------------------------- planted violations


def a_valid_token(batch, sample: int = 3) -> tuple[int, int]:
    """A valid token in the middle of ``sample`` whose returns and advantages are far from 0."""
    valid = torch.nonzero(batch.mask[sample]).flatten().tolist()
    for t in valid[len(valid) // 2 :]:
        if min(abs(float(batch.returns[sample, t])), abs(float(batch.advantage_raw[sample, t])),
               abs(float(batch.advantages[sample, t])), abs(float(batch.rewards[sample, t]))) > 0.05:  # fmt: skip
            return sample, t
    raise AssertionError("no suitable token")


PLANTS = {
    # identity: (tensor to corrupt, estimator case)
    "advantage_raw": ("advantage_raw", "gae_ext"),
    "advantage_raw decoupled": ("advantage_raw", "gae_ext-decoupled"),
    "whitening": ("advantages", "mc"),
    "returns": ("returns", "td0"),
    "returns nstep": ("returns", "nstep-3"),
    "advantage_raw turn_gae": ("advantage_raw", "turn_gae"),
    "returns turn_gae": ("returns", "turn_gae-critic-lambda"),
    "rewards": ("rewards", "mc"),
}


@pytest.mark.parametrize("plant", PLANTS)
def test_catches_one_token_changed_by_one_percent(tmp_path, plant):
    field, case = PLANTS[plant]
    identity = plant.split()[0]
    name, extra, args = DEFINED[case]
    batches = {step: by_definition(random_batch(step, kl_coef=0.5, dense_scores=True), **args) for step in (1, 2)}
    sample, token = a_valid_token(batches[2])
    nudge(getattr(batches[2], field), sample, token)  # after the returns: for "rewards", r ≠ s − β·kl
    report = check_trace(write_trace(tmp_path / "t", algorithm(name, kl="kl", **extra), batches))
    result = report[identity]
    assert result.status == "fail"
    loc = result.first.location
    assert (loc.step, loc.sample, loc.token_index) == (2, sample, token)
    assert f"step 2, sample {sample}, token {token}" in str(result.first)
    assert result.max_abs_error > result.first.tolerance


def test_catches_corrupt_whitening_statistics(tmp_path):
    path = defined_trace(tmp_path, "gae_ext")

    def shift_mean(entry):
        entry["whiten"]["mean"] *= 1.01
        return entry

    rewrite_step(path, 1, entry=shift_mean)
    report = check_trace(path)
    assert report["whitening_stats"].status == "fail"
    assert str(report["whitening_stats"].first.location) == "step 1"
    assert report["whitening"].status == "pass"  # the advantages themselves are right


def test_a_step_whose_rows_are_not_the_run_records_fails_its_layout(tmp_path):
    """The run record's ``rows`` of a step is the token table's row count: a record saying 5 fails."""
    path = defined_trace(tmp_path, "gae_ext")
    rows = pq.read_table(f"{path}/{token_file(1)}").num_rows
    assert rows != 5

    def five_rows(entry):
        entry["rows"] = 5
        return entry

    rewrite_step(path, 1, entry=five_rows)
    result = check_trace(path)["mask_layout"]
    assert result.status == "fail" and result.violations == 1 and str(result.first.location) == "step 1"
    assert result.first.column == "rows" and (result.first.actual, result.first.expected) == (rows, 5)


def test_truncated_steps_are_whitened_with_the_recorded_statistics(tmp_path):
    path = defined_trace(tmp_path, "gae_ext", max_samples=3)
    report = check_trace(path)
    assert report.passed
    assert report["whitening"].status == "pass"
    assert report["whitening"].notes == ("all steps: traced 3 of 6 samples: checked with the recorded batch μ, σ²",)
    assert report["whitening_stats"].status == "skipped"

    rewrite_step(
        path, 2, entry=lambda e: {**e, "whiten": {"mean": e["whiten"]["mean"] + 0.05, "var": e["whiten"]["var"]}}
    )
    report = check_trace(path)
    assert report["whitening"].status == "fail"  # proves the recorded statistics are what is used
    assert report["whitening"].first.location.step == 2


def test_a_sample_without_valid_tokens_is_not_a_truncation(tmp_path):
    name, extra, args = DEFINED["gae_ext"]
    b = random_batch(1)
    b.mask[4] = 0  # no rows in the trace for sample 4, but it is in the batch
    report = check_trace(write_trace(tmp_path / "t", algorithm(name, **extra), {1: by_definition(b, **args)}))
    assert report.passed
    assert report["whitening_stats"].status == "pass" and report["whitening"].notes == ()


def bf16_batches(rewards_in_bf16: bool) -> dict:
    """Two steps of td0 with the KL in the reward as a bf16 trainer makes them: kl is bf16 (from bf16
    log-probs), β·kl is multiplied in bf16; ``rewards_in_bf16``: the batch also holds the rewards so."""
    batches = {}
    for step in (1, 2):
        b = random_batch(step, kl_coef=0.3)
        kl = b.kl.to(torch.bfloat16)
        rewards = b.scores - 0.3 * kl  # float32 − bf16 product: the product rounded in bf16
        rewards = rewards.to(torch.bfloat16) if rewards_in_bf16 else rewards
        defined = by_definition(replace(b, kl=kl.float(), rewards=rewards.float()), "td0", gamma=1.0)
        batches[step] = replace(defined, kl=kl, rewards=rewards)
    return batches


def stored_dtypes(path: str, step: int) -> dict:
    metadata = pq.ParquetFile(f"{path}/{token_file(step)}").schema_arrow.metadata
    return json.loads(metadata[STEP_RECORD_METADATA_KEY.encode()])["stored_dtypes"]


@pytest.mark.parametrize("rewards_in_bf16", [False, True], ids=["bf16-kl", "bf16-kl-and-rewards"])
def test_rewards_of_a_bf16_trainer_pass_with_their_recorded_dtypes_and_only_so(tmp_path, rewards_in_bf16):
    """verl's V1 trainer in bf16 multiplies β into a bf16 kl (one bf16 rounding of β·kl); a trainer may
    also hold the rewards themselves in bf16. The capture records the dtype of each tensor it read and
    the identity allows exactly those roundings (half an ulp each), no more."""
    path = write_trace(tmp_path / "t", algorithm("td0", kl="kl"), bf16_batches(rewards_in_bf16))
    assert stored_dtypes(path, 1) == {"kl": "bf16", **({"reward": "bf16"} if rewards_in_bf16 else {})}
    report = check_trace(path)["rewards"]
    assert report.status == "pass", str(report.first)
    assert any("kl held in bf16 by the trainer" in note for note in report.notes)
    assert any("reward held in bf16 by the trainer" in note for note in report.notes) == rewards_in_bf16
    for step in (1, 2):  # the same numbers without the record of their dtypes: float32 identities they miss
        rewrite_step(path, step, entry=lambda e: {**e, "stored_dtypes": {}})
    assert check_trace(path)["rewards"].status == "fail"


def test_a_reward_off_by_more_than_bf16_roundings_still_fails(tmp_path):
    batches = bf16_batches(rewards_in_bf16=True)
    sample, token = valid_positions(batches[1])[3]
    batches[1].rewards[sample, token] = float(batches[1].rewards[sample, token]) * 1.05 + 0.05  # bf16 rounds by 0.4%
    report = check_trace(write_trace(tmp_path / "t", algorithm("td0", kl="kl"), batches))["rewards"]
    assert report.status == "fail" and (report.first.location.sample, report.first.location.token_index) == (sample, token)


def test_kl_in_reward_without_a_recorded_beta_fails(tmp_path):
    path = defined_trace(tmp_path, "mc")
    rewrite_step(path, 1, entry=lambda e: {**e, "kl_coef": None})
    result = check_trace(path)["rewards"]
    assert result.status == "fail"
    assert "no β" in result.first.detail


# -------------------------------------------------------------------------------- layout and finiteness


def test_catches_a_missing_row(tmp_path):
    path = defined_trace(tmp_path, "mc")

    def drop_row_5_of_sample_2(table):
        drop = pc.and_(pc.equal(table["sample"], 2), pc.equal(table["token_index"], 5))
        return table.filter(pc.invert(drop))

    rewrite_step(path, 1, table=drop_row_5_of_sample_2)
    result = check_trace(path)["mask_layout"]
    assert result.status == "fail"
    assert (result.first.location.sample, result.first.location.token_index) == (2, 6)
    assert "rows run 0…n−1" in result.first.detail


def test_catches_rows_past_the_last_valid_token(tmp_path):
    path = defined_trace(tmp_path, "mc")

    def mask_last_row_of_sample_0(table):
        last = pc.max(pc.filter(table["token_index"], pc.equal(table["sample"], 0))).as_py()
        hit = pc.and_(pc.equal(table["sample"], 0), pc.equal(table["token_index"], last))
        return table.set_column(table.schema.get_field_index("mask"), "mask", pc.and_(table["mask"], pc.invert(hit)))

    rewrite_step(path, 2, table=mask_last_row_of_sample_0)
    result = check_trace(path)["mask_layout"]
    assert result.status == "fail"
    assert result.first.location.step == 2 and result.first.location.sample == 0
    assert "the policy's last token" in result.first.detail


def test_catches_a_wrong_turn_and_skips_a_trace_without_turns(tmp_path):
    """The first hole of sample 1 (random_batch's holes) given the turn after it; then the column
    null, as in a trace before format 4."""
    algo = algorithm("mc")
    batch = by_definition(random_batch(1, T=30, holes=3), "mc", 1.0)
    path = write_trace(tmp_path / "trace", algo, {1: batch})
    mask = batch.mask[1].bool().tolist()
    hole = next(t for t in range(1, len(mask)) if mask[t - 1] and not mask[t] and any(mask[t:]))
    turn_index = TOKEN_SCHEMA.get_field_index("turn")

    def into_the_next_turn(table):
        hit = pc.and_(pc.equal(table["sample"], 1), pc.equal(table["token_index"], hole))
        return table.set_column(turn_index, "turn", pc.if_else(hit, pc.add(table["turn"], 1), table["turn"]))

    rewrite_step(path, 1, table=into_the_next_turn)
    result = check_trace(path)["turns"]
    assert (result.status, result.violations) == ("fail", 1)
    assert (result.first.location.sample, result.first.location.token_index) == (1, hole)
    assert (result.first.actual, result.first.expected) == (1.0, 0.0)
    rewrite_step(path, 1, table=lambda table: table.set_column(turn_index, "turn", pa.nulls(table.num_rows, pa.int32())))
    assert check_trace(path)["turns"].status == "skipped"


def test_catches_a_hole_written_as_the_assistants_and_a_valid_token_without_a_role(tmp_path):
    """The first hole token of sample 1 given the role "assistant", then also a valid token of sample
    2 a null role: each is one violation, found at the first in row order."""
    algo = algorithm("mc")
    batch = by_definition(random_batch(1, T=30, holes=3), "mc", 1.0)
    path = write_trace(tmp_path / "trace", algo, {1: batch})
    mask = batch.mask[1].bool().tolist()
    hole = next(t for t in range(1, len(mask)) if mask[t - 1] and not mask[t])
    written = next(t for t, valid in enumerate(batch.mask[2].bool().tolist()) if valid)
    role_index = TOKEN_SCHEMA.get_field_index("role")

    def at(table, sample, token):
        return pc.and_(pc.equal(table["sample"], sample), pc.equal(table["token_index"], token))

    def hole_as_assistant(table):
        return table.set_column(role_index, "role", pc.if_else(at(table, 1, hole), "assistant", table["role"]))

    def and_no_role(table):
        return table.set_column(role_index, "role", pc.if_else(at(table, 2, written), pa.scalar(None, pa.string()), table["role"]))

    assert check_trace(path)["roles"].status == "pass"
    rewrite_step(path, 1, table=hole_as_assistant)
    result = check_trace(path)["roles"]
    assert (result.status, result.violations) == ("fail", 1)
    assert (result.first.location.sample, result.first.location.token_index) == (1, hole)
    assert result.first.detail == "role 'assistant', expected not assistant (a hole)"
    rewrite_step(path, 1, table=and_no_role)
    result = check_trace(path)["roles"]
    assert (result.status, result.violations) == ("fail", 2) and result.first.location.sample == 1
    rewrite_step(path, 1, table=lambda table: table.set_column(role_index, "role", pc.if_else(at(table, 1, hole), "tool", table["role"])))
    result = check_trace(path)["roles"]
    assert (result.status, result.violations) == ("fail", 1)
    assert (result.first.location.sample, result.first.location.token_index) == (2, written)
    assert result.first.detail == "role None, expected assistant (the policy's token)"


def test_catches_a_tool_reward_off_its_turn_end_and_rewards_without_it(tmp_path):
    """Sample 1's tool reward moved one token before its turn's last token (the rewards moved with it:
    rewards still = scores + turn rewards), then the rewards alone left without it."""
    batch = by_definition(random_batch(1, T=30, holes=2, turn_rewards=True), "mc", 1.0)
    end = int(torch.nonzero(batch.tool_reward[1]).flatten()[0])
    assert batch.mask[1, end] and not batch.mask[1, end + 1]  # random_batch put it before a hole
    moved = batch.tool_reward.clone()
    moved[1, end - 1], moved[1, end] = moved[1, end], 0.0
    shifted = replace(batch, tool_reward=moved, rewards=batch.rewards - batch.tool_reward + moved)
    report = check_trace(write_trace(tmp_path / "moved", algorithm("mc"), {1: shifted}))
    result = report["turn_rewards"]
    assert (result.status, result.violations) == ("fail", 1) and report["rewards"].status == "pass"
    assert (result.first.location.sample, result.first.location.token_index, result.first.column) == (1, end - 1, "tool_reward")
    # an exact identity's line has no error and no tolerance to print (check's report said it with a TypeError)
    assert str(result.first).startswith(f"step 1, sample 1, token {end - 1}: tool_reward = ") and str(result.first).endswith(", expected 0")
    left_out = replace(batch, rewards=batch.rewards - batch.tool_reward)
    report = check_trace(write_trace(tmp_path / "left_out", algorithm("mc"), {1: left_out}))
    assert report["rewards"].status == "fail" and report["turn_rewards"].status == "pass"
    assert (report["rewards"].first.location.sample, report["rewards"].first.location.token_index) == (1, end)


def test_catches_a_non_finite_value(tmp_path):
    name, extra, args = DEFINED["gae_ext"]
    batches = {1: by_definition(random_batch(1), **args)}
    batches[1].values[2, 3] = float("nan")
    report = check_trace(write_trace(tmp_path / "t", algorithm(name, **extra), batches))
    assert report["finite"].status == "fail"
    assert str(report["finite"].first) == "step 1, sample 2, token 3: value = nan: not finite"


def test_a_step_of_the_run_record_missing_on_disk_fails_the_check(trace, run_cli):
    shutil.rmtree(trace / "step-3")
    code, out, _ = run_cli("check", str(trace), "--quiet")
    assert code == 1
    assert "checked:   2 steps" in out
    assert "8.5  every step and update table of the run record is on disk" in out and "FAIL (1 file)" in out
    assert "step 3: step-3/part-0.parquet: listed in the run record, missing on disk" in out


def test_a_nan_return_is_reported_where_it_is_not_as_a_whitening_error(tmp_path, run_cli):
    batches = {step: by_definition(random_batch(step), "td0", gamma=1.0) for step in (1, 2)}
    batches[2].returns[1, 2] = float("nan")
    code, out, _ = run_cli("check", write_trace(tmp_path / "t", algorithm("td0"), batches), "--quiet")
    assert code == 1
    lines = {line.split("  ")[1]: line for line in out.splitlines() if line[:1] == "8"}
    assert lines["advantages = masked_whiten(raw advantage)"].endswith("pass")
    assert "return = nan: not finite" in out
    assert "entrys" not in out and "FAIL (1 token)" in out


def test_a_value_based_run_without_values_fails(tmp_path):
    name, extra, args = DEFINED["mc"]
    b = by_definition(random_batch(1), **args)
    report = check_trace(write_trace(tmp_path / "t", algorithm(name, **extra), {1: replace(b, values=None)}))
    assert report["finite"].status == "fail"
    assert report["finite"].first.column == "value"
    assert report["returns"].status == "fail"


# -------------------------------------------------------------------------------- critic-free estimators


def test_grpo_identities_that_need_a_critic_are_not_applicable(tmp_path):
    b = random_batch(1, kl_coef=0.01)
    scores = (b.scores * b.mask).sum(dim=1, keepdim=True) * b.mask  # grpo: advantages = returns, no values
    b = replace(b, values=None, returns=scores, advantages=scores, advantage_raw=None)
    report = check_trace(write_trace(tmp_path / "t", algorithm("grpo", kl="kl"), {1: b}))
    for identity in ("advantage_raw", "whitening", "whitening_stats", "returns"):
        assert report[identity].status == "skipped"
        assert "not applicable: verl's 'grpo' estimator" in report[identity].notes[0]
    for identity in ("rewards", "mask_layout", "finite"):
        assert report[identity].status == "pass"
    assert report.passed


def test_a_users_estimator_that_does_not_import_here_is_not_checked_never_passed(tmp_path, monkeypatch):
    """The README's td_half, its module absent: the identities that recompute it apply to the run but
    are not evaluated ("unchecked", not "skipped"), so the verdict is incomplete, never pass; whitening
    is still checked (the run record says the run whitened), per-turn rewards stay not applicable."""
    from tests.integration.test_user_estimator import td_half_trace

    monkeypatch.chdir(tmp_path)  # no my_estimators.py here
    monkeypatch.setattr(sys, "path", [*sys.path])  # the checker puts the current directory on it, as a run does
    report = check_trace(td_half_trace(tmp_path / "trace"))
    expected = {key: "pass" for key in IDENTITIES} | {"advantage_raw": "unchecked", "returns": "unchecked", "turn_rewards": "skipped"}
    assert statuses(report) == expected
    assert report.verdict == "incomplete" and report.passed is False
    assert report["advantage_raw"].title == "raw advantage recomputed: td_half"
    assert report.algorithm.describe() == "td_half, whitened, KL in reward (low_var_kl)"
    [(reason, identities)] = report.not_checked.items()
    assert identities == ("advantage_raw", "returns")
    assert reason.startswith("estimator 'td_half' is not importable here: No module named 'my_estimators'; put ")
    as_dict = report.to_dict()
    assert as_dict["verdict"] == "incomplete" and as_dict["passed"] is False
    assert as_dict["not_checked"] == [{"reason": reason, "identities": ["advantage_raw", "returns"]}]

    def nudge_the_first_advantage(table):
        advantage = table.column("advantage").to_pylist()
        row = table.column("mask").to_pylist().index(True)
        advantage[row] *= 1.01
        return table.set_column(table.schema.get_field_index("advantage"), "advantage", pa.array(advantage, pa.float32()))

    nudged = td_half_trace(tmp_path / "nudged")  # a violation fails the check, whatever was not checked
    rewrite_step(nudged, 2, table=nudge_the_first_advantage)
    report = check_trace(nudged)
    assert report.verdict == "fail" and report["whitening"].status == "fail"


def test_report_as_data(tmp_path):
    report = check_trace(defined_trace(tmp_path, "td0"))
    table = report.to_arrow()
    assert table.num_rows == 2 * len(IDENTITIES)
    assert set(table.column("status").to_pylist()) == {"pass"}
    as_dict = report.to_dict()
    assert as_dict["passed"] is True and as_dict["steps"] == [1, 2]
    assert [i["identity"] for i in as_dict["identities"]] == list(IDENTITIES)
