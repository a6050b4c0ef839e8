"""`verl-ext check` under each ``algorithm.truncation`` (docs/definitions.md#truncated-responses): traces
whose numbers come from direct sums that carry V(s_L) explicitly pass; a wrong bootstrap_value, a
wrong advantage, a masked response with an advantage, whitening over the cut responses, and a cut
response without its V(s_L) fail (never pass); an older trace reads and checks as terminal."""

import json
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.inspect.inspect_helpers import algorithm, nudge, rewrite_step, whiten
from tests.inspect.test_inspect_check import IDENTITIES, statuses
from tests.inspect.truncation_helpers import CUT, by_definition, cut_batch, row_sums, truncation_of, write
from verl_ext.check.run import check_trace
from verl_ext.trace.reader import open_trace
from verl_ext.trace.schema import prompt_file

MODES = ("terminal", "bootstrap", "mask")
#: (estimator, its record keys, by_definition arguments), γ < 1 throughout
CASES = {
    "mc": ("mc", {"gamma": 0.9}, dict(name="mc", gamma=0.9)),
    "td0": ("td0", {"gamma": 0.9}, dict(name="td0", gamma=0.9)),
    "nstep": ("nstep", {"gamma": 0.9, "n_step": 3}, dict(name="nstep", gamma=0.9, n=3)),
    "gae_ext": ("gae_ext", {"gamma": 0.9, "lam": 0.8}, dict(name="gae_ext", gamma=0.9, lam=0.8)),
    "gae_ext-not-whitened": ("gae_ext", {"gamma": 0.9, "lam": 0.8, "whiten_advantages": False}, dict(name="gae_ext", gamma=0.9, lam=0.8, whitened=False)),
    "verl-gae": ("gae", {"gamma": 0.9, "lam": 0.8}, dict(name="gae", gamma=0.9, lam=0.8)),
    "turn_gae": ("turn_gae", {"gamma": 0.9, "lam": 0.8, "lam_critic": 0.8}, dict(name="turn_gae", gamma=0.9, lam=0.8)),
}  # fmt: skip
#: The identities only a run of that truncation has.
OWN = {"terminal": (), "bootstrap": ("bootstrap_value",), "mask": ("cut_advantage",)}


def trace_of(tmp_path: Path, case: str, mode: str, steps=(1, 2), plant=None, max_samples=None, name="trace") -> str:
    estimator, extra, args = CASES[case]
    written = {}
    for step in steps:
        b, cut, v_l = cut_batch(step, kl_coef=0.05)
        b = by_definition(b, cut, v_l, mode, **args)
        truncation = truncation_of(mode, cut, v_l)
        if plant is not None:
            b, truncation = plant(step, b, truncation)
        written[step] = (b, truncation)
    return write(tmp_path / name, algorithm(estimator, kl="kl", truncation=mode, **extra), written, max_samples)


def expected_statuses(case: str, mode: str) -> dict[str, str]:
    expected = {key: "pass" for key in (*IDENTITIES, *OWN[mode])} | {"turn_rewards": "skipped"}
    if "not-whitened" in case:
        expected["whitening_stats"] = "skipped"
    return expected


def test_the_direct_sums_differ_by_mode_where_they_should():
    """The references themselves: a cut row's returns move under bootstrap by γ^{L−t}·V(s_L) (mc),
    an ended row's do not; mask keeps the terminal returns and zeroes the cut rows' advantages."""
    b, cut, v_l = cut_batch(1)
    terminal = by_definition(b, cut, v_l, "terminal", "mc", 0.9)
    bootstrap = by_definition(b, cut, v_l, "bootstrap", "mc", 0.9)
    masked = by_definition(b, cut, v_l, "mask", "mc", 0.9)
    valid = b.mask.bool()
    row = 1  # cut, with a hole: 8 valid tokens, so the first is 8 steps from s_L
    assert float(bootstrap.returns[row, 0] - terminal.returns[row, 0]) == pytest.approx(0.9**8 * float(v_l[row]), abs=1e-6)
    assert torch.equal(bootstrap.returns[~cut][valid[~cut]], terminal.returns[~cut][valid[~cut]])
    assert torch.equal(masked.returns, terminal.returns)
    assert (masked.advantages[cut][valid[cut]] == 0).all() and (masked.advantages[~cut][valid[~cut]] != 0).all()
    assert row_sums("td0", [1.0, 2.0], [0.5, 0.25], 4.0, 0.5) == ([1.0 + 0.5 * 0.25, 2.0 + 0.5 * 4.0], [0.625, 3.75])
    assert row_sums("gae", [0.0, 0.0], [0.5, 0.6], 0.8, 0.9, 0.5)[1] == pytest.approx([0.45 * 0.12 + 0.04, 0.9 * 0.8 - 0.6])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES)
def test_passes_traces_built_from_the_definitions(tmp_path, case, mode):
    report = check_trace(trace_of(tmp_path, case, mode))
    assert statuses(report) == expected_statuses(case, mode), [str(r.first) for r in report.identities if r.first]
    assert report.passed
    assert report.algorithm.truncation == mode
    assert report.algorithm.describe().endswith("" if mode == "terminal" else f", truncation={mode}")


def test_the_trace_records_what_the_estimate_used(tmp_path):
    """The prompt table: the cut flags, V(s_L) on exactly the cut rows under bootstrap, null elsewhere."""
    _, cut, v_l = cut_batch(1, kl_coef=0.05)  # as trace_of draws it
    for mode in MODES:
        prompts = open_trace(trace_of(tmp_path, "mc", mode, steps=(1,), name=mode)).prompts(1)
        assert prompts["truncated"].to_pylist() == CUT
        expected = [float(torch.tensor(v, dtype=torch.float32)) if c and mode == "bootstrap" else None for v, c in zip(v_l.tolist(), CUT)]
        assert prompts["bootstrap_value"].to_pylist() == expected, mode


def rewrite_prompts(trace_dir: str, step: int, change) -> None:
    """Replace a step's prompt table by ``change(table)``, keeping its footer (the write id)."""
    path = f"{trace_dir}/{prompt_file(step)}"
    table = pq.read_table(path)
    pq.write_table(change(table).replace_schema_metadata(table.schema.metadata), path)


def set_bootstrap_value(sample: int, value):
    def change(table):
        values = table["bootstrap_value"].to_pylist()
        values[sample] = value
        at = table.schema.get_field_index("bootstrap_value")
        return table.set_column(at, "bootstrap_value", pa.array(values, pa.float32()))

    return change


@pytest.mark.parametrize("case", ["mc", "gae_ext", "verl-gae"])
def test_a_wrong_bootstrap_value_fails_the_returns(tmp_path, case):
    path = trace_of(tmp_path, case, "bootstrap")
    value = open_trace(path).prompts(2)["bootstrap_value"][1].as_py()
    rewrite_prompts(path, 2, set_bootstrap_value(1, value * 1.01 + 0.01))
    report = check_trace(path)
    assert report["returns"].status == "fail" and report["bootstrap_value"].status == "pass"
    first = report["returns"].first
    assert (first.location.step, first.location.sample, first.column) == (2, 1, "return")
    assert report.verdict == "fail"


def test_a_cut_response_without_its_bootstrap_value_fails_and_its_returns_are_not_checked(tmp_path):
    path = trace_of(tmp_path, "gae_ext", "bootstrap")
    rewrite_prompts(path, 1, set_bootstrap_value(5, None))
    report = check_trace(path)
    assert report["bootstrap_value"].status == "fail"
    first = report["bootstrap_value"].first
    assert (first.location.step, first.location.sample, first.column) == (1, 5, "bootstrap_value")
    assert "a cut response without a finite bootstrap_value" in str(first) and "#truncated-responses" in str(first)
    assert report["returns"].status == "unchecked" and report["advantage_raw"].status == "pass"  # one λ: R − V, elementwise
    [(reason, identities)] = report.not_checked.items()
    assert identities == ("returns",) and "no V(s_L) (bootstrap_value)" in reason
    assert report.verdict == "fail" and not report.passed


def test_a_bootstrap_value_on_a_response_that_ended_fails(tmp_path):
    path = trace_of(tmp_path, "td0", "bootstrap")
    rewrite_prompts(path, 2, set_bootstrap_value(3, 0.5))  # ended on EOS at T
    report = check_trace(path)
    assert report["bootstrap_value"].status == "fail" and report["bootstrap_value"].violations == 1
    assert "not cut" in str(report["bootstrap_value"].first)


def test_terminal_numbers_under_a_bootstrap_record_fail(tmp_path):
    """A run that says bootstrap but estimated as if terminal."""
    def terminal_numbers(step, b, truncation):
        return by_definition(b, truncation.cut, truncation.bootstrap_value, "terminal", "gae_ext", 0.9, lam=0.8), truncation

    report = check_trace(trace_of(tmp_path, "gae_ext", "bootstrap", plant=terminal_numbers))
    assert report["returns"].status == "fail" and report["returns"].first.location.sample in (0, 1, 5)


@pytest.mark.parametrize("mode", ["bootstrap", "mask"])
@pytest.mark.parametrize(("column", "identity"), [("advantages", "whitening"), ("returns", "returns")])
def test_a_planted_change_fails(tmp_path, mode, column, identity):
    def plant(step, b, truncation):
        if step == 2:
            nudge(getattr(b, column), 2, 4)  # a row not cut
        return b, truncation

    report = check_trace(trace_of(tmp_path, "nstep", mode, plant=plant))
    assert report[identity].status == "fail"
    first = report[identity].first
    assert (first.location.step, first.location.sample, first.location.token_index) == (2, 2, 4)


@pytest.mark.parametrize("case", ["mc", "verl-gae", "gae_ext-not-whitened"])
def test_a_masked_response_with_an_advantage_fails(tmp_path, case):
    def plant(step, b, truncation):
        if step == 1:
            b.advantages[0, 3] = 0.25
        return b, truncation

    report = check_trace(trace_of(tmp_path, case, "mask", plant=plant))
    assert report["cut_advantage"].status == "fail" and report["cut_advantage"].violations == 1
    first = report["cut_advantage"].first
    assert (first.location.step, first.location.sample, first.location.token_index) == (1, 0, 3)
    assert "trains on nothing" in str(first)
    assert report["whitening"].status == "fail"


def whitened_over_every_row(step, b, truncation):
    """A run that masked the cut rows after whitening over all of them."""
    advantages = torch.where(truncation.cut[:, None], torch.zeros_like(b.advantage_raw), whiten(b.advantage_raw, b.mask))
    return replace(b, advantages=advantages), truncation


def test_whitening_over_the_cut_responses_fails(tmp_path):
    report = check_trace(trace_of(tmp_path, "td0", "mask", plant=whitened_over_every_row))
    assert report["whitening"].status == "fail" and report["cut_advantage"].status == "pass"
    assert report["whitening_stats"].status == "pass"  # the capture's statistics are the estimate's: over rows not cut

    path = trace_of(tmp_path, "td0", "mask", name="statistics")
    table = open_trace(path).read_step(1)
    every_row = [a for a, valid in zip(table["advantage_raw"].to_pylist(), table["mask"].to_pylist()) if valid]
    mean, var = moments(every_row)
    rewrite_step(path, 1, entry=lambda entry: {**entry, "whiten": {"mean": mean, "var": var}})
    report = check_trace(path)
    assert report["whitening_stats"].status == "fail" and report["whitening"].status == "pass"


def moments(values) -> tuple[float, float]:
    """μ and the unbiased σ² of ``values``, by hand."""
    n = len(values)
    mean = sum(values) / n
    return mean, sum((x - mean) ** 2 for x in values) / (n - 1)


def test_the_recorded_statistics_are_over_the_rows_not_cut(tmp_path):
    """max_samples_per_step keeps rows 0-2 (two of them cut): their advantages are checked with the
    statistics the capture recorded for the whole batch, which are the ones over the rows not cut."""
    path = trace_of(tmp_path, "mc", "mask", max_samples=3)
    trace = open_trace(path)
    b, cut, v_l = cut_batch(1, kl_coef=0.05)
    raw = by_definition(b, cut, v_l, "mask", "mc", 0.9).advantage_raw
    kept = [float(raw[row, t]) for row in range(len(CUT)) if not CUT[row] for t in range(10) if b.mask[row, t]]
    recorded = trace.step_record(1).whiten
    mean, var = moments(kept)
    assert recorded["mean"] == pytest.approx(mean, rel=1e-6) and recorded["var"] == pytest.approx(var, rel=1e-5)
    report = check_trace(path)
    assert report.passed and report["whitening_stats"].status == "skipped"
    assert "traced 3 of 6 samples: checked with the recorded batch μ, σ²" in report["whitening"].notes[0]

    planted = trace_of(tmp_path, "mc", "mask", max_samples=3, plant=whitened_over_every_row, name="planted")
    assert check_trace(planted)["whitening"].status == "fail"


def test_grpo_with_mask_checks_the_masked_advantages_only(tmp_path):
    """verl's grpo: the group statistics (without the cut responses) are not in the trace, so its
    advantage identities stay not applicable; the cut responses' zero advantages are checked."""
    def grpo(step, plant):
        b, cut, _ = cut_batch(step, kl_coef=0.01)
        scores = (b.scores * b.mask).sum(dim=1, keepdim=True) * b.mask
        advantages = torch.where(cut[:, None], torch.zeros_like(scores), scores)
        if plant:
            advantages[5, 9] = 1.0
        return replace(b, values=None, returns=scores, advantages=advantages, advantage_raw=None), truncation_of("mask", cut, None)

    for plant in (False, True):
        path = write(tmp_path / f"grpo{plant}", algorithm("grpo", kl="kl", truncation="mask"), {1: grpo(1, plant)})
        report = check_trace(path)
        for identity in ("advantage_raw", "whitening", "whitening_stats", "returns"):
            assert report[identity].status == "skipped" and "not applicable: verl's 'grpo'" in report[identity].notes[0]
        assert report["cut_advantage"].status == ("fail" if plant else "pass")
        assert report.verdict == ("fail" if plant else "pass")


def test_a_run_that_treats_cuts_apart_without_cut_flags_fails(tmp_path):
    path = trace_of(tmp_path, "td0", "mask")
    rewrite_prompts(path, 1, lambda t: t.set_column(t.schema.get_field_index("truncated"), "truncated", pa.nulls(t.num_rows, pa.bool_())))
    report = check_trace(path)
    assert report["cut_advantage"].status == "fail" and "does not say which responses were cut" in str(report["cut_advantage"].first)
    assert report["whitening"].status == "unchecked" and report["whitening_stats"].status == "unchecked"
    assert report["returns"].status == "pass"  # a masked run's returns are the terminal ones
    assert report.verdict == "fail"


def test_an_unknown_truncation_in_the_run_record_is_a_trace_error(tmp_path):
    from verl_ext.errors import TraceError

    path = Path(trace_of(tmp_path, "mc", "terminal", steps=(1,)))
    record = json.loads((path / "_run.json").read_text())
    record["algorithm"]["truncation"] = "drop"
    (path / "_run.json").write_text(json.dumps(record))
    with pytest.raises(TraceError, match="algorithm.truncation is 'drop', expected one of terminal, bootstrap, mask"):
        check_trace(str(path))


def test_a_format_6_trace_reads_and_checks_as_terminal(tmp_path):
    """A trace from before format 7: no bootstrap_value in its prompt files, no truncation in its run
    record. It reads with the column null, and checks as terminal (without the truncation identities)."""
    path = Path(trace_of(tmp_path, "gae_ext", "terminal"))
    record = json.loads((path / "_run.json").read_text())
    del record["algorithm"]["truncation"]
    (path / "_run.json").write_text(json.dumps({**record, "schema_version": 6}))
    for parquet in path.rglob("*.parquet"):
        table = pq.read_table(parquet)
        metadata = {**table.schema.metadata, b"verl_ext.schema_version": b"6"}
        if "bootstrap_value" in table.column_names:
            table = table.drop_columns(["bootstrap_value"])
        pq.write_table(table.replace_schema_metadata(metadata), parquet)
    assert "bootstrap_value" not in pq.read_schema(path / prompt_file(1)).names

    trace = open_trace(str(path))
    assert trace.record.schema_version == 6
    prompts = trace.prompts(1)
    assert prompts["bootstrap_value"].null_count == prompts.num_rows and prompts["truncated"].to_pylist() == CUT
    report = check_trace(trace)
    assert report.algorithm.truncation == "terminal" and report.passed
    assert statuses(report) == expected_statuses("gae_ext", "terminal")


def test_a_step_whose_every_response_was_masked_has_advantage_0_throughout(tmp_path):
    b, _, _ = cut_batch(1, kl_coef=0.05)
    every = torch.ones(len(CUT), dtype=torch.bool)
    b = by_definition(b, every, None, "terminal", "td0", 0.9)
    for advantages, verdict in ((torch.zeros_like(b.advantages), "pass"), (b.advantages, "fail")):
        path = write(tmp_path / verdict, algorithm("td0", gamma=0.9, kl="kl", truncation="mask"), {1: (replace(b, advantages=advantages), truncation_of("mask", every, None))})
        report = check_trace(path)
        assert report["whitening"].status == verdict and report["cut_advantage"].status == verdict
        assert report["whitening_stats"].status == "skipped"
        assert "the cut responses are outside it: truncation=mask" in report["whitening_stats"].notes[0]


def test_the_report_names_the_truncation_and_its_identities(tmp_path, run_cli):
    code, out, _ = run_cli("check", trace_of(tmp_path, "gae_ext", "bootstrap"), "--quiet")
    assert code == 0
    assert "estimator: gae_ext(γ=0.9, λ=0.8), whitened, KL in reward (kl), truncation=bootstrap" in out
    rows = {line.split("  ")[1]: line for line in out.splitlines() if line[:1] == "8"}
    assert rows["bootstrap_value present exactly on cut responses"].startswith("8.7")
    assert rows["bootstrap_value present exactly on cut responses"].endswith("pass")
    assert rows["returns recomputed: gae_ext(γ=0.9, λ=0.8), cut responses from their bootstrap_value"].endswith("pass")

    path = trace_of(tmp_path, "gae_ext", "bootstrap", name="lacking")
    rewrite_prompts(path, 1, set_bootstrap_value(0, None))
    code, out, _ = run_cli("check", path, "--quiet")
    assert code == 1
    assert "FAIL (1 response)" in out and "NOT CHECKED" in out
