"""Every number in docs/definitions.md is checked here, against values computed independently:
direct sums written from the definitions, verl's own functions, and (for the command output shown
in the document) the real ``verl-ext show`` and ``verl-ext check`` on a trace of the example.

Numbers live in blocks between ``<!-- verified: NAME -->`` and ``<!-- /verified -->``; each NAME has a
test below, and a test fails if a verified block disappears from the document.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

import tests.support.reference as reference

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "definitions.md"

# The "是的，等于2！" example (seed dialogue 000): six response tokens, the outcome score on the last.
TOKENS = ["是", "的", "，", "等于", "2", "！"]
SCORES = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
KL = [0.1, 0.05, -0.05, 0.1, 0.2, 0.05]
BETA = 0.1
VALUES = [0.20, 0.25, 0.30, 0.35, 0.45, 0.60]
REWARDS = [s - BETA * k for s, k in zip(SCORES, KL)]


# ------------------------------------------------------------------ the definitions, as direct sums (tests/support/reference.py), γ = 1


def td_residuals(r, v):
    return list(reference.deltas_row(r, v, 1.0))


def mc_return(r):
    return list(reference.mc_row(r, 1.0))


def nstep_return(r, v, n):
    return list(reference.nstep_row(r, v, 1.0, n))


def gae(r, v, lam):
    return list(reference.gae_row(r, v, 1.0, lam))


def whiten(x):
    """verl's masked_whiten over one fully valid row."""
    return list(reference.whiten([x], [[1] * len(x)])[0])


def verl_gae(r, v, lam):
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    mask = torch.ones(1, len(r), dtype=torch.float64)
    adv, ret = compute_gae_advantage_return(
        torch.tensor([r], dtype=torch.float64), torch.tensor([v], dtype=torch.float64), mask, 1.0, lam
    )
    return adv[0].tolist(), ret[0].tolist()


# ------------------------------------------------------------------ reading the document


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def verified_block(name: str) -> str:
    """The text between ``<!-- verified: name -->`` and the next ``<!-- /verified -->``."""
    match = re.search(rf"<!-- verified: {re.escape(name)} -->\n(.*?)\n<!-- /verified -->", doc_text(), re.S)
    assert match, f"docs/definitions.md has no block marked 'verified: {name}'"
    return match.group(1).strip("\n")


def verified_table(name: str) -> dict[str, list[str]]:
    """Columns of a Markdown table, by header (cells stripped, ``**`` removed)."""
    lines = [line for line in verified_block(name).splitlines() if line.startswith("|")]
    rows = [[cell.strip().replace("**", "") for cell in line.strip("|").split("|")] for line in lines]
    header, body = rows[0], rows[2:]
    return {h: [row[i] for row in body] for i, h in enumerate(header)}


def numbers(cells: list[str]) -> list[float]:
    return [float(c.replace("−", "-")) for c in cells]


def assert_shown(cells: list[str], expected: list[float]) -> None:
    """Each cell equals the expected number to the decimals the cell shows."""
    assert len(cells) == len(expected)
    for cell, value in zip(cells, expected):
        decimals = len(cell.split(".")[1]) if "." in cell else 0
        assert abs(float(cell.replace("−", "-")) - value) <= 0.5 * 10**-decimals + 1e-12, (cell, value)


def test_every_verified_block_has_a_test():
    names = set(re.findall(r"<!-- verified: ([\w-]+) -->", doc_text()))
    tested = {name.removeprefix("test_").replace("_", "-") for name in globals() if name.startswith("test_")}
    assert names and names <= tested, names - tested


# ------------------------------------------------------------------ the tables


def test_three_token_example():
    """docs/definitions.md §5: r = [0, 0, 1], V = [0.3, 0.4, 0.6], γ = 1."""
    table = verified_table("three-token-example")
    r, v = numbers(table["r_t"]), numbers(table["V_t"])
    assert (r, v) == ([0, 0, 1], [0.3, 0.4, 0.6])
    assert_shown(table["δ_t"], td_residuals(r, v))
    assert_shown(table["MC return G_t"], mc_return(r))
    assert_shown(table["MC advantage"], [g - vi for g, vi in zip(mc_return(r), v)])
    assert_shown(table["TD(0) advantage = δ_t"], td_residuals(r, v))
    assert_shown(table["GAE λ=0.95 advantage"], gae(r, v, 0.95))
    assert_shown(table["GAE λ=0.95 return"], [a + vi for a, vi in zip(gae(r, v, 0.95), v)])
    verl_adv, verl_ret = verl_gae(r, v, 0.95)
    assert_shown(table["GAE λ=0.95 return"], verl_ret)  # verl agrees


def test_turn_gae_example():
    """docs/definitions.md §7, turns: two turns around a tool answer, γ = 1, λ = λ_critic = 0.95."""
    table = verified_table("turn-gae-example")
    assistant = [i for i, role in enumerate(table["role"]) if role == "assistant"]
    assert [role for role in table["role"]] == ["assistant"] * 3 + ["tool"] * 2 + ["assistant"] * 2
    mask = [1 if role == "assistant" else 0 for role in table["role"]]
    r = [float(c) if c != "—" else 0.0 for c in table["r_t"]]
    v = [float(c) if c != "—" else 0.0 for c in table["V_t"]]
    assert [r[i] for i in assistant] == [0, 0, 0.1, 0, 1] and [v[i] for i in assistant] == [0.3, 0.4, 0.5, 0.6, 0.8]
    turns = reference.turns_of_row(mask)
    assert [[int(table["turn k"][i]) for i in turn] for turn in turns] == [[0] * 3, [1] * 2]
    # R_k, V_k and δ_k written by hand from the definitions, on the first row of each turn
    firsts = [turn[0] for turn in turns]
    R = [sum(r[i] for i in turn) for turn in turns]
    V = [v[i] for i in firsts] + [0.0]
    assert_shown([table["R_k"][i] for i in firsts], R)
    assert_shown([table["V_k"][i] for i in firsts], V[:-1])
    assert_shown([table["δ_k"][i] for i in firsts], [R[k] + V[k + 1] - V[k] for k in range(2)])
    turn_level = reference.turn_gae_row(r, v, mask, 1.0, 0.95)
    assert_shown([table["`turn_gae` advantage A_k"][i] for i in assistant], turn_level[assistant])
    compact_r, compact_v = [r[i] for i in assistant], [v[i] for i in assistant]
    assert_shown([table["GAE λ=0.95 advantage"][i] for i in assistant], gae(compact_r, compact_v, 0.95))
    returns = [a + x for a, x in zip(gae(compact_r, compact_v, 0.95), compact_v)]
    assert_shown([table["return (both)"][i] for i in assistant], returns)
    # verl-ext's estimator gives the table's numbers (the hole holds junk it must not read)
    from verl_ext import registry

    entry = registry.get("turn_gae")
    junk = [x if m else 99.0 for x, m in zip(r, mask)], [x if m else -99.0 for x, m in zip(v, mask)]
    result = registry.run(
        entry, torch.tensor([junk[0]]), torch.tensor([junk[1]]), torch.tensor([mask]),
        entry.settings({"gamma": 1.0, "lam": 0.95, "whiten_advantages": False}),
    )  # fmt: skip
    assert_shown([table["`turn_gae` advantage A_k"][i] for i in assistant], result.advantage_raw[0, assistant].tolist())
    assert_shown([table["return (both)"][i] for i in assistant], result.returns[0, assistant].tolist())


# The cut response of docs/definitions.md#truncated-responses, and its numbers worked by hand there.
CUT_R, CUT_V, CUT_V_AFTER, CUT_GAMMA, CUT_LAM = [0.0, 0.0, 0.0], [0.4, 0.5, 0.6], 0.8, 0.9, 0.5
CUT_BY_HAND = {
    "terminal δ_t": [0.05, 0.04, -0.6], "terminal A_t": [-0.0535, -0.23, -0.6], "terminal return": [0.3465, 0.27, 0.0],
    "bootstrap δ_t": [0.05, 0.04, 0.12], "bootstrap A_t": [0.0923, 0.094, 0.12], "bootstrap return": [0.4923, 0.594, 0.72],
    "mask A_t": [0.0, 0.0, 0.0],
    "MC return, terminal": [0.0, 0.0, 0.0], "MC return, bootstrap": [0.5832, 0.648, 0.72],
    "`turn_gae` A, terminal": [-0.4] * 3, "`turn_gae` A, bootstrap": [0.32] * 3,
}  # fmt: skip


def cut_estimate(name: str, mode: str, **settings):
    """verl-ext's estimator ``name`` on the cut response under ``mode`` (verl_ext.registry.run, the
    code path of training), in float64, not whitened."""
    from verl_ext import registry
    from verl_ext.truncation import Truncation

    entry = registry.get(name)
    truncation = Truncation(mode, torch.tensor([True]), torch.tensor([CUT_V_AFTER], dtype=torch.float64))
    return registry.run(
        entry, torch.tensor([CUT_R], dtype=torch.float64), torch.tensor([CUT_V], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64),
        entry.settings({"gamma": CUT_GAMMA, "lam": CUT_LAM, "whiten_advantages": False, **settings}), truncation=truncation,
    )  # fmt: skip


def test_truncation_example():
    """docs/definitions.md#truncated-responses: the hand calculation, and gae_ext under each option gives it."""
    table = verified_table("truncation-example")
    assert (numbers(table["r_t"]), numbers(table["V_t"])) == (CUT_R, CUT_V)
    for column, expected in CUT_BY_HAND.items():
        if column in table:
            assert_shown(table[column], expected)
    # the hand calculation against the definitions: δ with V_3 = 0 or V(s_L), A_t = δ_t + γλ·A_{t+1}
    for mode, v_after in (("terminal", 0.0), ("bootstrap", CUT_V_AFTER)):
        values = [*CUT_V, v_after]
        deltas = [CUT_R[t] + CUT_GAMMA * values[t + 1] - values[t] for t in range(3)]
        assert deltas == pytest.approx(CUT_BY_HAND[f"{mode} δ_t"], abs=1e-12)
        advantages = [deltas[2], deltas[1] + CUT_GAMMA * CUT_LAM * deltas[2]]
        advantages.append(deltas[0] + CUT_GAMMA * CUT_LAM * advantages[1])
        assert advantages[::-1] == pytest.approx(CUT_BY_HAND[f"{mode} A_t"], abs=1e-12)
    for mode in ("terminal", "bootstrap", "mask"):
        result = cut_estimate("gae_ext", mode)
        shown_mode = "terminal" if mode == "mask" else mode  # mask keeps the terminal returns
        assert_shown(table[f"{shown_mode} return"], result.returns[0].tolist())
        assert_shown(table[f"{mode} A_t"], result.advantages[0].tolist())


def test_truncation_example_others():
    """The same cut response under mc and turn_gae (one turn), and bootstrap as the terminal estimate
    on r'_{L−1} = r_{L−1} + γ·V(s_L), with verl's own GAE too."""
    table = verified_table("truncation-example-others")
    for column in table:
        if column != "t":
            assert_shown(table[column], CUT_BY_HAND[column])
    for mode in ("terminal", "bootstrap"):
        assert_shown(table[f"MC return, {mode}"], cut_estimate("mc", mode).returns[0].tolist())
        assert_shown(table[f"`turn_gae` A, {mode}"], cut_estimate("turn_gae", mode).advantage_raw[0].tolist())
    rewritten = [*CUT_R[:2], CUT_R[2] + CUT_GAMMA * CUT_V_AFTER]
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    _, returns = compute_gae_advantage_return(
        torch.tensor([rewritten], dtype=torch.float64), torch.tensor([CUT_V], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64), CUT_GAMMA, CUT_LAM
    )  # fmt: skip
    # verl whitens the advantages it returns: the raw one is its return − V
    assert returns[0].tolist() == pytest.approx(CUT_BY_HAND["bootstrap return"], abs=1e-12)
    assert (returns[0] - torch.tensor(CUT_V, dtype=torch.float64)).tolist() == pytest.approx(CUT_BY_HAND["bootstrap A_t"], abs=1e-12)


def test_seed_example_rewards():
    table = verified_table("seed-example-rewards")
    assert table["token"] == TOKENS
    assert_shown(table["score s_t"], SCORES)
    assert_shown(table["kl_t"], KL)
    assert_shown(table["reward r_t = s_t − 0.1·kl_t"], REWARDS)
    assert_shown(table["value V_t"], VALUES)
    assert_shown(table["δ_t"], td_residuals(REWARDS, VALUES))


def test_seed_example_credit():
    table = verified_table("seed-example-credit")
    assert table["token"] == TOKENS
    assert_shown(table["MC"], [g - v for g, v in zip(mc_return(REWARDS), VALUES)])
    assert_shown(table["2-step"], [g - v for g, v in zip(nstep_return(REWARDS, VALUES, 2), VALUES)])
    assert_shown(table["TD(0)"], td_residuals(REWARDS, VALUES))
    assert_shown(table["GAE λ=0.5"], gae(REWARDS, VALUES, 0.5))
    assert_shown(table["GAE λ=0.95"], gae(REWARDS, VALUES, 0.95))
    # the identities the text states, on this example
    assert gae(REWARDS, VALUES, 0.0) == pytest.approx(td_residuals(REWARDS, VALUES))
    assert gae(REWARDS, VALUES, 1.0) == pytest.approx([g - v for g, v in zip(mc_return(REWARDS), VALUES)])
    assert nstep_return(REWARDS, VALUES, 6) == pytest.approx(mc_return(REWARDS))
    lam, L = 0.95, len(REWARDS)
    for t in range(L):  # λ-return = (1−λ) Σ λ^{n−1} G^(n) + λ^{L−t−1} G
        mixture = (1 - lam) * sum(lam ** (n - 1) * nstep_return(REWARDS, VALUES, n)[t] for n in range(1, L - t))
        mixture += lam ** (L - t - 1) * mc_return(REWARDS)[t]
        assert mixture == pytest.approx(gae(REWARDS, VALUES, lam)[t] + VALUES[t])


def test_seed_example_whitening():
    table = verified_table("seed-example-whitening")
    raw = gae(REWARDS, VALUES, 0.95)
    assert_shown(table["return = raw + V"], [a + v for a, v in zip(raw, VALUES)])
    assert_shown(table["raw advantage"], raw)
    assert_shown(table["whitened advantage"], whiten(raw))
    verl_adv, _ = verl_gae(REWARDS, VALUES, 0.95)
    assert_shown(table["whitened advantage"], verl_adv)


def test_seed_example_whitening_stats():
    stats = verified_table("seed-example-whitening-stats")
    raw = gae(REWARDS, VALUES, 0.95)
    assert_shown(stats["μ"], [statistics.mean(raw)])
    assert_shown(stats["σ"], [statistics.stdev(raw)])


def test_value_includes_reward():
    """Seed 003's own table (question 3): V(t) = r(t) + … + r(6), so V(t) − V(t+1) = r(t)."""
    table = verified_table("value-includes-reward")
    r = numbers(table["r(t)"])
    assert_shown(table["V(t) = r(t) + V(t+1)"], mc_return(r))
    assert_shown(table["V(t) − V(t+1)"], r)


def test_seed_000_gae_slip():
    """Seed 000 question 3 dropped V_{t+1} − V_t from δ_t."""
    table = verified_table("seed-000-gae-slip")
    r = [-0.01] * 5 + [0.99]
    assert table["in the dialogue"] == ["0.27", "0.28", "0.30", "0.33", "0.36", "0.39"]  # quoted, A_1 … A_6
    assert_shown(table["δ_t"], td_residuals(r, VALUES))
    assert_shown(table["A_t"], gae(r, VALUES, 0.95))
    slipped = [float(c) for c in table["in the dialogue"]]
    assert all(abs(a - b) > 0.02 for a, b in zip(slipped[:5], gae(r, VALUES, 0.95)[:5]))


# ------------------------------------------------------------------ the command output shown


def example_trace(directory: Path) -> str:
    """The seed example as verl computes it (GAE γ = 1, λ = 0.95, KL in reward, β = 0.1), traced."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    from verl_ext.options import TraceOptions
    from verl_ext import registry
    from verl_ext.trace.capture import StepCapture
    from verl_ext.trace.schema import RunRecord
    from verl_ext.trace.writer import TraceWriter

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<unk>", "<s>", "</s>", *"请问1+=2？是的，", "等于", "！"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("等于|."), behavior="isolated")  # 等于 is one token
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    tokenizer.save_pretrained(directory / "tokenizer")
    response = torch.tensor([tokenizer.convert_tokens_to_ids(TOKENS)])
    prompt = torch.tensor([tokenizer("请问1+1=2？")["input_ids"]])

    scores, kl, values = torch.tensor([SCORES]), torch.tensor([KL]), torch.tensor([VALUES])
    rewards = scores - BETA * kl
    mask = torch.ones(1, 6)
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, 1.0, 0.95)
    options = TraceOptions(dir=str(directory / "trace"))
    algorithm = {
        "adv_estimator": "gae", "gamma": 1.0, "lam": 0.95, "n_step": None, "lam_critic": None, "lam_actor": None,
        "lam_length_alpha": None, "whiten_advantages": True, "norm_adv_by_std_in_grpo": True,
        "use_kl_in_reward": True, "kl_penalty": "kl", "kl_ctrl": {"type": "fixed", "kl_coef": BETA},
    }  # fmt: skip
    record = RunRecord(
        verl_ext_version="docs", verl_version="0.9.1", trainer="legacy", created_at="",
        algorithm=algorithm, model_path="", tokenizer_path=str(directory / "tokenizer"), rollout_n=1,
        trace=options.as_dict(),
    )  # fmt: skip
    with TraceWriter(options, record) as writer:
        writer.submit(
            StepCapture(
                step=1,
                mask=mask,
                token_id=response,
                uid=["q1"],
                floats={
                    "score": scores, "reward": rewards, "value": values, "return": returns, "advantage": advantages,
                    "advantage_raw": returns - values, "kl": kl,
                },
                prompts=prompt,
                kl_coef=BETA,
                whitening=registry.whitening_statistics(returns - values, mask),
            )  # fmt: skip
        )
    return str(directory / "trace")


def test_show_output(tmp_path, run_cli):
    """The `verl-ext show` output printed in the document is what the command prints."""
    trace = example_trace(tmp_path)
    code, out, _ = run_cli("show", trace, "--format", "markdown")
    assert code == 0
    shown = verified_block("show-output")
    assert shown.strip() == out.strip()


def test_check_output(tmp_path, run_cli):
    """The document's example trace passes `verl-ext check`; the table shown is its table (the
    max abs error column, float rounding of this machine, aside)."""
    code, out, _ = run_cli("check", example_trace(tmp_path), "--quiet")
    assert code == 0

    def without_errors(text: str) -> list[list[str]]:
        return [[c for i, c in enumerate(re.split(r"\s{2,}", line.strip())) if i != 2] for line in text.splitlines()]

    shown = verified_block("check-output").split("\n", 1)[1].rsplit("\n", 1)[0]  # inside the ``` fence
    assert without_errors(shown) == without_errors(out.split("\n\n")[1])
    assert out.splitlines()[-1] == "PASS (10 passed, 0 failed, 1 skipped)"


def test_seed_004_update():
    """§8, the update: each row's term and clip from verl's own compute_policy_loss_vanilla, one token
    at a time (a one-token token-mean is the token's term), ε = 0.2, c = 3."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
    from verl.workers.config import ActorConfig

    table = verified_table("seed-004-update")
    advantage, old, new = numbers(table["A_t"]), numbers(table["old_log_prob"]), numbers(table["log_prob"])
    assert advantage == [0.13, 0.10, 0.08, 0.05, 0.03, 0.05]  # seed dialogue 004
    assert old == [-0.12, -0.08, -0.15, -0.10, -0.05, -0.02]
    assert [round(n - o, 10) for n, o in zip(new, old)] == [0.3, 0.1, -0.3, 0.0, 0.25, -0.5]
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2)

    def verl_term(a, log_prob, old_log_prob):
        t = lambda x: torch.tensor([[x]], dtype=torch.float64)  # noqa: E731
        loss, metrics = compute_policy_loss_vanilla(
            old_log_prob=t(old_log_prob), log_prob=t(log_prob), advantages=t(a),
            response_mask=torch.ones(1, 1, dtype=torch.bool), loss_agg_mode="token-mean", config=config,
        )  # fmt: skip
        return float(loss), metrics["actor/pg_clipfrac"] > 0

    first = [verl_term(a, o, o) for a, o in zip(advantage, old)]
    later = [verl_term(a, n, o) for a, n, o in zip(advantage, new, old)]
    assert_shown(table["ratio"], [math.exp(n - o) for n, o in zip(new, old)])
    assert_shown(table["term (first mini-batch)"], [term for term, _ in first])
    assert_shown(table["term"], [term for term, _ in later])
    assert table["clip"] == ["high" if clipped else "none" for _, clipped in later]
    text = doc_text()
    assert f"−{abs(np.mean([t for t, _ in first])):.4f} at the first mini-batch" in text
    assert f"−{abs(np.mean([t for t, _ in later])):.4f} later" in text


def test_update_columns():
    """§9: every column of the update tables is in the document's table, and nothing else."""
    from verl_ext.trace.schema import UPDATE_COLUMNS

    table = verified_table("update-columns")
    documented = {kind: set() for kind in ("actor", "critic")}
    for kind, cell in zip(table["table"], table["column"]):
        for name in re.findall(r"`(\w+)`", cell):
            for k in (("actor", "critic") if kind == "both" else (kind,)):
                documented[k].add(name)
    for kind, columns in UPDATE_COLUMNS.items():
        assert documented[kind] == {c.name for c in columns} - {"step"}, kind


def test_the_verl_versions_table_is_what_setup_cfg_accepts_and_ci_installs():
    """Issue 18: the accepted range is the tested range. The table of docs/gpu.md's "Supported verl
    versions" lists the verl releases setup.cfg accepts among those ever tried, and they are the one
    setup.cfg pins exactly (what `make test` installs in CI; constraints.txt leaves verl to it rather
    than pin it a second time); each touch's range lies inside the accepted one."""
    import configparser

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from verl_ext.touches import SUPPORTED_VERL, TOUCHES

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    requirements = [Requirement(line) for line in config["options"]["install_requires"].split("\n") if line.strip()]
    accepted = next(r.specifier for r in requirements if r.name == "verl")
    assert str(accepted) == SUPPORTED_VERL  # the package's range is read from setup.cfg, not written twice
    constraints = [line for line in (ROOT / "constraints.txt").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert "verl" not in {Requirement(line).name for line in constraints}  # setup.cfg's pin is the only one
    (pinned,) = [spec.version for spec in accepted if spec.operator == "=="]  # one exact version: what CI installs
    page = (ROOT / "docs" / "gpu.md").read_text()
    table = page.split("<!-- verl-versions -->")[1].split("<!-- /verl-versions -->")[0]
    rows = [line.split("|")[1].strip() for line in table.strip().splitlines()[2:]]
    tried = ["0.6.1", "0.7.1", "0.8.0", "0.9.0", "0.9.1", "0.9.2", "0.10.0"]
    assert rows == [v for v in tried if accepted.contains(v)] == [pinned]
    pins = {Requirement(line).name: next(iter(Requirement(line).specifier)).version for line in constraints}
    for touch in TOUCHES:  # written for what CI installs: verl's pin, or the pin of the package it touches
        assert SpecifierSet(touch.versions).contains(pinned if touch.package == "verl" else pins[touch.package]), touch.name


# ------------------------------------------------------------------ references to sections


def test_every_section_and_anchor_reference_resolves():
    """Every ``§N``, ``….md#anchor`` and ``[…, section N](…#anchor)`` in the code, the README and the
    docs lands on a heading (tests/support/doc_references.py says how each is read)."""
    from tests.support.doc_references import scanned_files, unresolved

    assert {"README.md", "docs/definitions.md", "verl_ext/check/identities.py", "verl_ext/view/static/viewer.js"} <= {
        path.relative_to(ROOT).as_posix() for path in scanned_files(ROOT)
    }
    wrong = unresolved(ROOT)
    assert not wrong, "references that land on no heading:\n" + "\n".join(map(str, wrong))


def test_a_reference_that_lands_nowhere_is_named_by_file_and_line(tmp_path):
    from tests.support.doc_references import unresolved

    section = "\u00a7"  # written apart, so that this file holds no reference of its own
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "definitions.md").write_text(doc_text(), encoding="utf-8")
    (tmp_path / "docs" / "notes.md").write_text(
        "# Notes\n\n## 1. First\n\nsee " + section + "1, and definitions.md " + section + "7\n\n"
        "[x](#1-first) [y](#" + "nowhere) [z](definitions.md#" + "tolerances)\n",
        encoding="utf-8",
    )  # fmt: skip
    (tmp_path / "verl_ext").mkdir()
    (tmp_path / "verl_ext" / "module.py").write_text(
        f'"""turns (docs/definitions.md {section}7), live metrics ({section}9)."""\n'
        f"# the multi-turn section ({section}11); docs/definitions.md{'#'}tolerances\n"
        f"COLOUR = '#ffffff'  # see docs/definitions.md{'#'}no-such-heading\n",
        encoding="utf-8",
    )
    (tmp_path / "README.md").write_text(
        f"[docs/definitions.md, section 7](docs/definitions.md{'#'}turns-one-advantage-per-assistant-turn-turn_gae)\n"
        f"[docs/definitions.md, section 5](docs/definitions.md{'#'}tolerances)\n"
        f"docs/definitions.md {section}8.6, docs/definitions.md {section}12, missing.md {section}1\n",
        encoding="utf-8",
    )
    assert [(u.path, u.line, u.reference) for u in unresolved(tmp_path)] == [
        ("README.md", 2, f"[docs/definitions.md, section 5](docs/definitions.md{'#'}tolerances)"),  # tolerances is in 8
        ("README.md", 3, f"{section}12"),
        ("README.md", 3, f"{section}1"),
        ("docs/notes.md", 7, f"{'#'}nowhere"),
        ("verl_ext/module.py", 2, f"{section}11"),
        ("verl_ext/module.py", 3, f"docs/definitions.md{'#'}no-such-heading"),
    ]
