"""The self-contained page (``verl-ext view TRACE --out FILE``) in a real headless chromium.

Expected values come from the trace's Parquet files read with pyarrow, from tests/support/reference.py's
direct sums, or from what was planted; never from the code under test.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.support import reference
from tests.view import chromium
from tests.view.conftest import START
from tests.view.view_helpers import (
    BETA, GAMMA, IMG, LAM, NAN_AT, SCRIPT, TOKENS_JS, VOCAB, compare_tokens, parquet_prompts, parquet_tokens,
    numbers_of, tokens_in_dom, write_view_trace,
)  # fmt: skip
from verl_ext.trace.schema import token_file, update_file
from verl_ext.view.page import SCRIPTS, viewer_script

pytestmark = pytest.mark.filterwarnings("ignore:One of rtol or atol is not valid:RuntimeWarning")  # the check of a NaN
STATIC = Path(__file__).resolve().parents[2] / "verl_ext" / "view" / "static"


def url(path: str, **state) -> str:
    return f"file://{path}" + ("#" + "&".join(f"{k}={v}" for k, v in state.items()) if state else "")


def show(page, path: str, step: int, sample: int, **state) -> None:
    page.goto(url(path, step=step, sample=sample, **state))
    page.wait_rendered(step, sample)


def valid_rows(trace: str, step: int, sample: int) -> list[dict]:
    return [row for row in parquet_tokens(trace, step, sample) if row["mask"]]


# ------------------------------------------------------------------ the data in the page is the trace's


def test_every_token_of_the_first_response_equals_the_trace(view_page, view_trace):
    """--dump-dom after the scripts ran: each token's text, id, mask, every column of the token table,
    the log-ratio old − rollout log-prob and each PPO epoch's update row, against the Parquet files."""
    dom = chromium.dump_dom(url(view_page))
    assert f'data-rendered="{START[0]}:{START[1]}"' in dom
    tokens = tokens_in_dom(dom)
    assert compare_tokens(tokens, view_trace, *START) == []
    assert len(tokens) == len(parquet_tokens(view_trace, *START)) > 5
    # the planted markup is text: its characters are in the DOM escaped, not as elements
    assert tokens[0]["text"] == SCRIPT and "&lt;script&gt;alert(1)&lt;/script&gt;" in dom
    # both update epochs are there, and each trained token has its rows
    assert any("e0.ratio" in numbers_of(t) for t in tokens) and any("e1.ratio" in numbers_of(t) for t in tokens)


def test_the_estimates_in_the_page_are_the_direct_sums(view_page, view_trace, page, long_samples):
    """δ_t and the re-estimated raw advantages of a response with an interior masked span, against
    tests/support/reference.py on the recorded rewards and values (float32 as shown)."""
    step, sample = 2, next(s for s in long_samples if s % 2 == 1)  # odd samples have an interior masked span
    show(page, view_page, step, sample)
    tokens = page.evaluate(TOKENS_JS)
    assert compare_tokens(tokens, view_trace, step, sample) == []
    valid = [numbers_of(t) for t in tokens if t["attrs"]["data-mask"] == "1"]
    assert len(valid) < len(tokens), "the chosen response has masked tokens"
    assert all("delta" not in numbers_of(t) for t in tokens if t["attrs"]["data-mask"] == "0")
    rows = valid_rows(view_trace, step, sample)
    r = [float(np.float32(row["reward"])) for row in rows]
    v = [float(np.float32(row["value"])) for row in rows]
    expected = {
        "delta": reference.deltas_row(r, v, GAMMA),
        "est.td0": reference.deltas_row(r, v, GAMMA),
        "est.mc": [g - x for g, x in zip(reference.mc_row(r, GAMMA), v)],
        "est.nstep3": [g - x for g, x in zip(reference.nstep_row(r, v, GAMMA, 3), v)],
        f"est.gae{LAM:g}": reference.gae_row(r, v, GAMMA, LAM),
    }
    for name, values in expected.items():
        shown = [float(numbers[name]) for numbers in valid]
        assert shown == pytest.approx(list(values), rel=1e-6, abs=1e-6), name


def test_the_prompt_is_the_decoded_prompt_as_text(view_page, view_trace, page):
    show(page, view_page, *START)
    ids = next(p for p in parquet_prompts(view_trace, START[0]) if p["sample"] == START[1])["prompt_token_ids"]
    assert page.evaluate("document.getElementById('prompt').textContent") == "".join(VOCAB[i] for i in ids)
    assert "等于" in page.evaluate("document.getElementById('prompt').textContent")
    assert page.evaluate("document.getElementById('prompt').children.length") == 0


def test_markup_in_tokens_and_prompts_never_runs(view_page, page):
    show(page, view_page, *START)
    assert page.dialogs() == []
    assert page.evaluate("window.__pwned === undefined")
    assert page.evaluate("document.querySelectorAll('img').length") == 0
    assert page.evaluate("document.scripts.length") == 2  # the data and the viewer, nothing planted
    texts = page.evaluate("[...document.querySelectorAll('#response .tok')].map(s => [s.textContent, s.children.length])")
    assert [SCRIPT, 0] in texts and [IMG.replace(" ", "␣"), 0] in texts
    assert all(children == 0 for _, children in texts)


def test_the_page_fetches_nothing(view_page, page):
    """Every request the page makes is the file itself: no CDN, no network; the policy forbids more."""
    page.send("Network.enable")
    show(page, view_page, *START)
    requested = [e["params"]["request"]["url"] for e in page.browser.events("Network.requestWillBeSent", page.session)]
    assert requested and all(u.startswith("file://") and view_page in u for u in requested), requested
    html = Path(view_page).read_text()
    assert re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html) is None
    policy = re.search(r'http-equiv="Content-Security-Policy" content="([^"]+)"', html).group(1)
    assert "default-src 'none'" in policy and "unsafe-inline" not in policy


def test_hovering_a_token_shows_all_its_numbers(view_page, view_trace, page):
    step, sample = START
    show(page, view_page, step, sample)
    rows = parquet_tokens(view_trace, step, sample)
    target = next(row for row in rows if row["mask"] and row["token_index"] > 0)
    page.hover(f"#response .tok[data-t='{target['token_index']}']")
    page.wait("document.querySelector('#details .piece') !== null", "the details of the hovered token")
    details = page.evaluate("[...document.querySelectorAll('#details tr')].map(tr => [...tr.cells].map(c => c.textContent))")
    numbers = {label: value for label, value in details}
    for name in ("score", "reward", "kl", "value", "return", "advantage_raw", "advantage", "old_log_prob", "rollout_log_prob"):
        assert float(numbers[name]) == pytest.approx(float(np.float32(target[name])), abs=1e-5), name
    text = page.evaluate("document.getElementById('details').textContent")
    assert "PPO epoch 0" in text and "PPO epoch 1" in text
    for kind in ("actor", "critic"):
        for update in pq.read_table(f"{view_trace}/{update_file(kind, step)}").to_pylist():
            if update["sample"] != sample or update["token_index"] != target["token_index"]:
                continue
            shown = dict(page.evaluate(f"[...document.querySelectorAll('#details table[data-epoch=\"{update['epoch']}\"] tr')].map(tr => [...tr.cells].map(c => c.textContent))"))
            for name in ("ratio", "log_prob", "pg_loss", "entropy") if kind == "actor" else ("vpred", "vf_loss"):
                assert float(shown[name]) == pytest.approx(float(np.float32(update[name])), abs=1e-5), (kind, name)
            if kind == "actor":
                assert shown["clip"] == update["clip"] and int(shown["minibatch"]) == update["minibatch"]
    assert page.evaluate("document.querySelector('#details .piece').textContent") == VOCAB[target["token_id"]].replace(" ", "␣")


# ------------------------------------------------------------------ moving around


def test_clicking_a_sample_a_group_member_and_the_next_step(view_page, view_trace, page, long_samples):
    step, sample = START
    show(page, view_page, step, sample)
    other = long_samples[1] if long_samples[0] == sample else long_samples[0]
    page.click(f"#sample-list a[data-sample='{other}']")
    page.wait_rendered(step, other)
    assert compare_tokens(page.evaluate(TOKENS_JS), view_trace, step, other) == []
    # its group: the responses of the same uid at this step
    uid = parquet_tokens(view_trace, step, other)[0]["uid"]
    group = sorted({row["sample"] for row in pq.read_table(f"{view_trace}/{token_file(step)}").to_pylist() if row["uid"] == uid})
    shown = page.evaluate("[...document.querySelectorAll('#group a[data-sample]')].map(a => Number(a.dataset.sample))")
    assert sorted(shown) == group and len(group) == 2
    mate = next(s for s in group if s != other)
    page.click(f"#group a[data-sample='{mate}']")
    page.wait_rendered(step, mate)
    page.click("#step-next")
    page.wait("document.body.dataset.rendered.startsWith('3:')", "step 3")
    shown_sample = int(page.evaluate("document.body.dataset.rendered").split(":")[1])
    assert shown_sample == mate  # the same sample at the next step
    assert compare_tokens(page.evaluate(TOKENS_JS), view_trace, 3, mate) == []


def test_the_same_prompt_at_the_other_steps(view_page, view_trace, page):
    step, sample = START
    show(page, view_page, step, sample)
    page.wait("document.querySelector('#across b') !== null", "the prompt across steps")
    ids = {s: {p["sample"]: p["prompt_token_ids"] for p in parquet_prompts(view_trace, s)} for s in (1, 2, 3)}
    mine = ids[step][sample]
    expected = {s: sorted(x for x, p in ids[s].items() if p == mine) for s in (1, 3)}
    shown = page.evaluate(
        "Object.fromEntries([...document.querySelectorAll('#across span[data-step]')].map(s => "
        "[s.dataset.step, [...s.querySelectorAll('a')].map(a => Number(a.dataset.sample))]))"
    )
    assert {int(k): sorted(v) for k, v in shown.items()} == expected and all(expected.values())
    page.click(f"#across span[data-step='3'] a[data-sample='{expected[3][0]}']")
    page.wait_rendered(3, expected[3][0])


def _step_samples(trace: str, step: int) -> dict[int, list[dict]]:
    rows = pq.read_table(f"{trace}/{token_file(step)}").to_pylist()
    out: dict[int, list[dict]] = {}
    for row in rows:
        out.setdefault(row["sample"], []).append(row)
    return out


def test_filters_list_exactly_the_matching_responses(view_page, view_trace, page):
    step = NAN_AT[0]
    samples = _step_samples(view_trace, step)
    scores = {s: sum(r["score"] for r in rows if r["mask"]) for s, rows in samples.items()}
    actor = pq.read_table(f"{view_trace}/{update_file('actor', step)}").to_pylist()
    expected = {
        "all": sorted(samples),
        "wrong": sorted(s for s, score in scores.items() if score < max(scores.values())),
        "truncated": sorted(p["sample"] for p in parquet_prompts(view_trace, step) if p["truncated"]),
        "clipped": sorted({u["sample"] for u in actor if u["clip"] != "none"}),
        "nonfinite": [NAN_AT[1]],
    }
    assert all(expected.values()) and len(expected["wrong"]) < len(samples) and len(expected["clipped"]) < len(samples)
    for name, wanted in expected.items():
        page.goto(url(view_page, step=step, filter=name))
        page.wait(f"document.body.dataset.stats === '{step}' && location.hash.includes('filter={name}')", f"filter {name}")
        shown = page.evaluate("[...document.querySelectorAll('#sample-list a[data-sample]')].map(a => Number(a.dataset.sample))")
        assert shown == wanted, name
        first = int(page.evaluate("document.body.dataset.rendered").split(":")[1])
        assert first == wanted[0], f"{name}: the first matching response is shown"
    # the planted NaN: marked on its token
    show(page, view_page, step, NAN_AT[1])
    marked = page.evaluate("[...document.querySelectorAll('#response .tok.nonfinite')].map(s => ({text: s.textContent, attrs: {'data-t': s.dataset.t, 'data-q': s.dataset.q}}))")
    assert [(m["attrs"]["data-t"], numbers_of(m)["value"]) for m in marked] == [(str(NAN_AT[2]), "NaN")]


def test_next_and_previous_stay_within_the_filter(view_page, view_trace, page):
    step = 3
    samples = _step_samples(view_trace, step)
    scores = {s: sum(r["score"] for r in rows if r["mask"]) for s, rows in samples.items()}
    wrong = sorted(s for s, score in scores.items() if score < max(scores.values()))
    # the test means something only if "next" has a response outside the filter to skip
    skipped = [s for s in range(wrong[0], wrong[-1]) if s not in wrong] if wrong else []
    assert len(wrong) >= 3 and skipped, (wrong, scores)
    show(page, view_page, step, wrong[0], filter="wrong")
    for expected in wrong[1:]:
        page.click("#sample-next")
        page.wait_rendered(step, expected)
    assert page.evaluate("document.getElementById('sample-next').disabled")  # the filter's last response
    page.click("#sample-prev")
    page.wait_rendered(step, wrong[-2])


# ------------------------------------------------------------------ colours


def _rgb(text: str) -> tuple[int, int, int]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _backgrounds(page) -> list[tuple[str, str | None, tuple]]:
    """(t, mask, the token's background colour, or None when it is not coloured) of every token."""
    return [
        (t, m, _rgb(bg) if coloured else None)
        for t, m, bg, coloured in page.evaluate(
            "[...document.querySelectorAll('#response .tok')].map(s => [s.dataset.t, s.dataset.mask, "
            "getComputedStyle(s).backgroundColor, [...s.classList].some(c => /^(c-?\\d+|c-inf|clip-.+)$/.test(c))])"
        )
    ]


@pytest.mark.parametrize("quantity", ["value", "advantage", "kl"])
def test_tokens_are_coloured_by_the_chosen_quantity_around_zero(view_page, view_trace, page, quantity):
    step, sample = 3, 1
    show(page, view_page, step, sample, colour=quantity)
    assert page.evaluate("document.getElementById('response').dataset.colour") == quantity
    step_values = [float(np.float32(r[quantity])) for rows in _step_samples(view_trace, step).values() for r in rows if r["mask"]]
    assert float(page.evaluate("document.getElementById('legend').dataset.scale")) == max(abs(x) for x in step_values)
    by_t = {r["token_index"]: float(np.float32(r[quantity])) for r in parquet_tokens(view_trace, step, sample)}
    for t, mask, rgb in _backgrounds(page):
        if mask == "0":
            assert rgb is None  # masked tokens are not coloured
        elif by_t[int(t)] > 0:
            assert rgb[0] > rgb[2], (t, by_t[int(t)], rgb)  # red side
        elif by_t[int(t)] < 0:
            assert rgb[2] > rgb[0], (t, by_t[int(t)], rgb)  # blue side


def test_ratio_is_centred_at_one_and_clip_regions_have_their_colours(view_page, view_trace, page):
    step, sample = 3, 2
    actor = [u for u in pq.read_table(f"{view_trace}/{update_file('actor', step)}").to_pylist() if u["sample"] == sample and u["epoch"] == 1]
    show(page, view_page, step, sample, colour="ratio", epoch=1)
    ratio = {u["token_index"]: u["ratio"] for u in actor}
    for t, mask, rgb in _backgrounds(page):
        if int(t) in ratio and ratio[int(t)] != 1:
            assert (rgb[0] > rgb[2]) == (ratio[int(t)] > 1), (t, ratio[int(t)], rgb)
    page.select("#colour", "clip")
    page.wait("document.getElementById('response').dataset.colour === 'clip'", "the clip colours")
    colours = {"none": (255, 255, 255), "low": (69, 117, 180), "high": (215, 48, 39), "dual": (123, 50, 148)}
    clip = {u["token_index"]: u["clip"] for u in actor}
    shown = {int(t): rgb for t, m, rgb in _backgrounds(page) if int(t) in clip}
    assert shown == {t: colours[code] for t, code in clip.items()}


def test_every_quantity_of_the_issue_can_colour_and_the_estimators_too(view_page, page):
    show(page, view_page, 3, 1)
    options = page.evaluate("[...document.getElementById('colour').options].map(o => o.value)")
    assert options[0] == "advantage"
    for key in ("advantage", "advantage_raw", "value", "return", "reward", "score", "kl", "delta", "entropy", "ratio", "clip", "log_ratio"):
        assert key in options
    assert {"est:mc", "est:td0", "est:nstep3", "est:gae0.5", "est:gae0.9", "est:gae0.95"} <= set(options)
    page.click("#compare-table tr[data-estimator='td0'] a")
    page.wait("document.getElementById('response').dataset.colour === 'est:td0'", "colour by td0")
    # td0's raw advantage is δ: the same colours as colouring by δ
    td0 = _backgrounds(page)
    page.select("#colour", "delta")
    page.wait("document.getElementById('response').dataset.colour === 'delta'", "colour by δ")
    assert _backgrounds(page) == td0


# ------------------------------------------------------------------ the step's numbers


def test_summary_line_and_comparison_of_a_step(view_page, view_trace, page):
    step = 3
    show(page, view_page, step, 0)
    samples = _step_samples(view_trace, step)
    stats = dict(page.evaluate("[...document.querySelectorAll('#step-summary .stat')].map(s => [s.dataset.key, Number(s.dataset.value)])"))
    assert stats["samples"] == len(samples)
    assert stats["tokens"] == sum(r["mask"] for rows in samples.values() for r in rows)
    assert stats["score"] == pytest.approx(np.mean([sum(r["score"] for r in rows if r["mask"]) for rows in samples.values()]), rel=1e-9)
    recorded = json.loads(Path(view_trace, "_run.json").read_text())["steps"][str(step)]["whiten"]
    assert stats["whiten_mean"] == pytest.approx(recorded["mean"]) and stats["whiten_sigma"] == pytest.approx(math.sqrt(recorded["var"]))
    for name in ("explained_var", "kl", "clip_low", "clip_high"):
        assert name in stats
    # the estimators compared: Var over the step of each raw advantage, from the direct sums
    rows = page.evaluate("[...document.querySelectorAll('#compare-table tr[data-estimator]')].map(tr => [tr.dataset.estimator, Number(tr.cells[1].dataset.value)])")
    assert [name for name, _ in rows] == ["mc", "td0", "nstep3", "gae0.5", "gae0.9", "gae0.95", "turn_gae"]
    mc, td0 = [], []
    for sample_rows in samples.values():
        valid = [r for r in sample_rows if r["mask"]]
        r = [float(np.float32(x["reward"])) for x in valid]
        v = [float(np.float32(x["value"])) for x in valid]
        mc += [g - x for g, x in zip(reference.mc_row(r, GAMMA), v)]
        td0 += list(reference.deltas_row(r, v, GAMMA))
    assert dict(rows)["mc"] == pytest.approx(np.var(mc, ddof=1), rel=1e-6)
    assert dict(rows)["td0"] == pytest.approx(np.var(td0, ddof=1), rel=1e-6)


def test_a_new_summary_field_and_comparison_statistic_reach_the_page_by_their_records(tmp_path, view_trace, page, monkeypatch):
    """A field added to the summary's schema (with the function that fills it) and a statistic added
    to the comparison's table are shown with their values, by their names; the viewer's script names neither."""
    import pyarrow as pa

    from verl_ext.inspect import comparison, summary
    from verl_ext.view import write_page

    monkeypatch.setattr(summary, "SUMMARY_SCHEMA", summary.SUMMARY_SCHEMA.append(pa.field("tokens_per_sample", pa.float64())))
    step_summary = summary.step_summary
    monkeypatch.setattr(summary, "step_summary", lambda data, gamma: step_summary(data, gamma) | {"tokens_per_sample": data.tokens / data.layout.samples})
    statistics = comparison.estimator_statistics

    def with_largest(raw, uid, sample_ids):
        table, notes = statistics(raw, uid, sample_ids)
        return table.append_column("max_abs", pa.array([float(np.max(np.abs(raw[label]))) for label in raw])), notes

    monkeypatch.setattr(comparison, "estimator_statistics", with_largest)
    step = 3
    out = write_page(view_trace, tmp_path / "page.html", step=step, sample=0, steps=[step])
    show(page, str(out), step, 0)
    samples = _step_samples(view_trace, step)
    stats = dict(page.evaluate("[...document.querySelectorAll('#step-summary .stat')].map(s => [s.dataset.key, [s.textContent, Number(s.dataset.value)]])"))
    text, value = stats["tokens_per_sample"]
    assert value == sum(r["mask"] for rows in samples.values() for r in rows) / len(samples)
    assert text.startswith("tokens_per_sample ")
    headers = page.evaluate("[...document.querySelectorAll('#compare-table th')].map(th => th.textContent)")
    assert headers[-1] == "max_abs"
    shown = page.evaluate("Number(document.querySelector(\"#compare-table tr[data-estimator='mc'] td[data-key='max_abs']\").dataset.value)")
    mc = []
    for rows in samples.values():
        valid = [r for r in rows if r["mask"]]
        r = [float(np.float32(x["reward"])) for x in valid]
        v = [float(np.float32(x["value"])) for x in valid]
        mc += [g - x for g, x in zip(reference.mc_row(r, GAMMA), v)]
    assert shown == pytest.approx(max(abs(x) for x in mc), rel=1e-9)
    source = viewer_script()
    assert "tokens_per_sample" not in source and "max_abs" not in source


def test_a_failing_check_points_at_its_token(tmp_path, piece_tokenizer, page, long_samples):
    """A return changed by 1% at (2, s, t): the page lists the failure there; its link shows the token."""
    sample = long_samples[0]
    trace = write_view_trace(tmp_path / "trace", piece_tokenizer, updates=False, planted=False, nudged=(2, sample, 3))
    from verl_ext.view import write_page

    out = write_page(trace, tmp_path / "page.html", step=1, sample=0)
    show(page, str(out), 1, 0)
    assert page.evaluate("document.getElementById('check').className").split() == ["panel", "fail"]
    failures = page.evaluate("[...document.querySelectorAll('#failures li')].map(li => [li.dataset.identity, li.dataset.step, li.dataset.sample, li.dataset.token])")
    assert ["returns", "2", str(sample), "3"] in failures
    assert all(f[1:] == ["2", str(sample), "3"] for f in failures)
    page.click("#failures li[data-identity='returns'] a")
    page.wait_rendered(2, sample)
    assert page.evaluate("[...document.querySelectorAll('#response .tok.focus')].map(s => s.dataset.t)") == ["3"]
    assert page.evaluate("document.querySelector('#details .piece') !== null")  # the token's numbers, pinned


def test_a_trace_that_passes_says_so(tmp_path, clean_trace, page):
    from verl_ext.view import write_page

    out = write_page(clean_trace, tmp_path / "clean.html")
    show(page, str(out), 3, 0)
    assert page.evaluate("document.getElementById('check').className").split() == ["panel", "pass"]
    assert "every identity" in page.evaluate("document.getElementById('check').textContent")


def test_a_check_that_could_not_evaluate_the_runs_estimator_says_so_never_holds(tmp_path, page, monkeypatch):
    """The README's td_half, its module absent where the page is made: the panel says which identities
    were not checked and why (verl-ext check: INCOMPLETE), not that every identity holds."""
    from tests.integration.test_user_estimator import td_half_trace
    from verl_ext.view import write_page

    monkeypatch.chdir(tmp_path)  # no my_estimators.py here, nor on sys.path
    monkeypatch.setattr(sys, "path", [*sys.path])
    out = write_page(td_half_trace(tmp_path / "trace"), tmp_path / "page.html")
    show(page, str(out), 2, 0)
    assert page.evaluate("document.getElementById('check').className").split() == ["panel", "incomplete"]
    text = page.evaluate("document.getElementById('check').textContent")
    assert "every identity" not in text and "2 identities not checked" in text
    assert "No module named 'my_estimators'" in text
    assert page.evaluate("[...document.querySelectorAll('#not-checked li')].map(li => li.dataset.identities)") == ["advantage_raw,returns"]


# ------------------------------------------------------------------ which steps go into a file


def test_a_small_budget_keeps_the_start_and_spreads_the_rest(tmp_path, view_trace, page, run_cli):
    rows = {s: len(pq.read_table(f"{view_trace}/{token_file(s)}")) for s in (1, 2, 3)}
    out = tmp_path / "small.html"
    code, stdout, err = run_cli("view", view_trace, "--out", str(out), "--step", "2", "--max-tokens", str(rows[2] + rows[1]), "-q")
    assert code == 0 and stdout.strip() == str(out) and err == ""
    show(page, str(out), 2, 0)
    assert page.evaluate("[...document.getElementById('step').options].map(o => Number(o.value))") == [1, 2]
    assert "this file holds 2 of the 3 traced steps" in page.evaluate("document.getElementById('notes').textContent")
    # a budget smaller than the start step: the start sample and its group, then the first that fit
    samples = _step_samples(view_trace, 2)
    out = tmp_path / "cut.html"
    budget = len(samples[6]) + len(samples[7]) + len(samples[0])
    assert run_cli("view", view_trace, "--out", str(out), "--step", "2", "--sample", "6", "--max-tokens", str(budget), "-q")[0] == 0
    show(page, str(out), 2, 6)
    listed = page.evaluate("[...document.querySelectorAll('#sample-list a')].map(a => [Number(a.dataset.sample), a.classList.contains('absent')])")
    assert [s for s, absent in listed if not absent] == [0, 6, 7]
    assert len(listed) == len(samples)
    page.click("#sample-list a[data-sample='3']")
    page.wait("document.body.dataset.rendered === '2:3'", "an absent sample")
    assert "not in this file" in page.evaluate("document.getElementById('response').textContent")


def test_spread_takes_first_last_then_middles():
    from verl_ext.view.page import spread

    assert spread([1, 2, 3, 4, 5, 6, 7, 8, 9]) == [1, 9, 5, 3, 7, 2, 4, 6, 8]
    assert spread([4]) == [4] and spread([]) == []
    assert sorted(spread(list(range(1, 41)))) == list(range(1, 41))


# ------------------------------------------------------------------ bad input, and the page's safety


def test_bad_input_is_one_line_and_exit_2(tmp_path, view_trace, run_cli, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cases = {
        ("--out", str(tmp_path / "p.html"), "--step", "99"): "has no step 99 (steps on disk: 1, 2, 3)",
        ("--out", str(tmp_path / "p.html"), "--step", "2", "--sample", "42"): "step 2 has no sample 42 (traced samples: 0, 1, 2, 3, 4, 5, 6, 7)",
        ("--out", str(blocker / "p.html")): f"cannot write {blocker / 'p.html'}: {blocker} is not a directory",
        ("--out", str(tmp_path)): f"cannot write {tmp_path}: it is a directory",
        ("--steps", "1,2"): "--steps chooses what goes into a file: it needs --out",
        ("--out", str(tmp_path / "p.html"), "--port", "9000"): "--port is for serving: leave out --out to serve the trace",
        ("--out", str(tmp_path / "p.html"), "--steps", "1,7"): "has no step 7 (steps on disk: 1, 2, 3)",
    }
    for arguments, message in cases.items():
        code, out, err = run_cli("view", view_trace, *arguments)
        assert code == 2 and out == "", arguments
        assert err.count("\n") == 1 and err.startswith("verl-ext view: ") and message in err, (arguments, err)
    assert not (tmp_path / "p.html").exists()
    for arguments, message in ((("--steps", "1,x"), "is not a list of steps"), (("--port", "70000"), "must be <= 65535")):
        with pytest.raises(SystemExit) as exit_info:
            run_cli("view", view_trace, *arguments)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_unwritable_output_leaves_nothing(tmp_path, view_trace, run_cli):
    target = Path("/proc/verl-ext-view.html")  # not writable even as root
    code, _, err = run_cli("view", view_trace, "--out", str(target), "-q")
    assert code == 2 and err.count("\n") == 1 and f"cannot write {target}" in err


def test_inline_data_cannot_close_its_element():
    from verl_ext.view.page import inline_json

    data = {"token": "</script><script>alert(1)</script><!-- & \u2028", "quote": '"'}
    text = inline_json(data)
    assert "<" not in text and ">" not in text and "&" not in text and "\u2028" not in text
    assert json.loads(text) == data


def test_the_page_runs_every_script_under_static_once(tmp_path, view_trace):
    """A script file added to static/ and not to page.SCRIPTS would never run: each is in the page."""
    from verl_ext.view import write_page

    assert sorted(SCRIPTS) == sorted(path.name for path in STATIC.glob("*.js")) and SCRIPTS[-1] == "viewer.js"
    page = write_page(view_trace, tmp_path / "page.html", step=1, steps=[1]).read_text()
    for name in SCRIPTS:
        assert page.count((STATIC / name).read_text()) == 1, name


def test_the_viewer_script_never_writes_markup():
    source = viewer_script()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in source, sink


def test_without_a_tokenizer_tokens_show_their_ids(tmp_path, view_trace, page, run_cli):
    out = tmp_path / "ids.html"
    code, _, err = run_cli("view", view_trace, "--out", str(out), "--step", "1", "--tokenizer", str(tmp_path / "none"), "-q")
    assert code == 0 and err.startswith("note: cannot load tokenizer") and err.count("\n") == 1
    show(page, str(out), 1, 2)
    rows = parquet_tokens(view_trace, 1, 2)
    assert page.evaluate("[...document.querySelectorAll('#response .tok')].map(s => s.textContent)") == [f"#{r['token_id']}" for r in rows]
    ids = next(p for p in parquet_prompts(view_trace, 1) if p["sample"] == 2)["prompt_token_ids"]
    assert page.evaluate("document.getElementById('prompt').textContent") == " ".join(f"#{i}" for i in ids)
    assert "cannot load tokenizer" in page.evaluate("document.getElementById('notes').textContent")
