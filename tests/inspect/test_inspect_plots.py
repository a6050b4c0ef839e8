import re
import warnings
from dataclasses import replace

import pytest
import torch
from tests.inspect.inspect_helpers import algorithm, by_verl_gae, random_batch, token_ids, write_trace

from verl_ext.inspect import plots
from verl_ext.inspect.plots import FontFallbackWarning, PlotNote, advantage_heatmap, label_font, save_plots

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def gae_trace(tmp_path, char_tokenizer) -> str:
    batches = {step: by_verl_gae(random_batch(step, kl_coef=0.05), 1.0, 0.95) for step in (1, 2, 3)}
    return write_trace(tmp_path / "t", algorithm("gae", lam=0.95, kl="kl"), batches, tokenizer_path=char_tokenizer)


def test_plot_command_writes_every_figure(gae_trace, tmp_path, run_cli):
    code, out, err = run_cli("plot", gae_trace, "--out", str(tmp_path / "plots"), "--sample", "1")
    assert code == 0
    names = [line.rsplit("/", 1)[1] for line in out.splitlines()]
    assert names == [
        "positions_step3.png",
        "over_steps.png",
        "value_vs_return_step3.png",
        "advantages_step3_sample1.png",
        "critic_ev.png",
    ]
    for line in out.splitlines():
        with open(line, "rb") as png:
            assert png.read(8) == PNG_SIGNATURE
    # random ids 7…19 decode to the tokenizer's digits and punctuation only: no font note
    assert "U+" not in err


def test_a_bad_plot_request_writes_nothing(trace, run_cli, tmp_path):
    out = tmp_path / "plots"
    code, _, err = run_cli("plot", str(trace), "--out", str(out), "--sample", "999")
    assert code == 2 and "has no sample 999" in err
    assert not out.exists()


@pytest.mark.parametrize("under", [False, True])
def test_an_out_that_is_a_file_is_refused_before_any_step_is_read(gae_trace, tmp_path, run_cli, monkeypatch, under):
    """`--out` naming a file (or a folder under one): one line, exit 2, before the scan of the steps
    (which takes minutes on a long run); the file is left as it was."""
    from verl_ext.trace.reader import Trace

    existing = tmp_path / "figures.png"
    existing.write_bytes(b"mine")
    read = []
    attempt = Trace._attempt
    monkeypatch.setattr(Trace, "_attempt", lambda self, relative, *rest: read.append(relative) or attempt(self, relative, *rest))
    out = existing / "plots" if under else existing
    code, stdout, err = run_cli("plot", gae_trace, "--out", str(out))
    assert read == [] and existing.read_bytes() == b"mine"
    assert (code, stdout) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"verl-ext plot: cannot write the figures to {out}: ") and "a file, not a directory" in err


def test_figures_that_do_not_apply_are_left_out_with_a_note(tmp_path):
    b = random_batch(1)
    b = replace(b, values=None, returns=b.scores, advantages=b.scores, advantage_raw=None)
    path = write_trace(tmp_path / "t", algorithm("grpo"), {1: b})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlotNote)
        written = save_plots(path, tmp_path / "plots")
    notes = [str(w.message) for w in caught if issubclass(w.category, PlotNote)]
    assert any(n.startswith("value_vs_return_step1.png left out: step 1 has no values") for n in notes), notes
    assert any(n.startswith("critic_ev.png left out: step 1 has no values") for n in notes), notes
    assert [p.name for p in written] == ["positions_step1.png", "over_steps.png", "advantages_step1_sample0.png"]


def test_cjk_without_a_cjk_font_falls_back_to_code_points_and_says_so(monkeypatch, tmp_path, char_tokenizer):
    monkeypatch.setattr(plots, "_candidate_fonts", lambda: [])  # as on a machine without CJK fonts
    font = label_font(["是的", "2！"])
    assert font.missing == {"是", "的", "！"}
    assert font.label("是的2！") == "U+662F U+7684 2 U+FF01"
    assert font.label("是") == "U+662F"
    assert "install a CJK font" in font.note
    assert label_font(["Жизнь", "αβγ"]).missing == frozenset()  # DejaVu Sans draws these

    b = by_verl_gae(random_batch(1), 1.0, 1.0)
    b.responses[0, :3] = torch.tensor(token_ids("是的！"))
    path = write_trace(tmp_path / "t", algorithm("gae"), {1: b}, tokenizer_path=char_tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = advantage_heatmap(path, sample=0)
    notes = [str(w.message) for w in caught if issubclass(w.category, FontFallbackWarning)]
    assert len(notes) == 1 and "3 character(s) (是的！): in plots they are shown as U+XXXX" in notes[0]
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "U+662F" in texts and "是" not in texts


def test_figures_draw_the_traces_numbers(gae_trace):
    """The data behind each figure, against numbers computed here from the trace's table with pandas."""
    import numpy as np

    from verl_ext.trace.reader import open_trace

    frame = open_trace(gae_trace).to_pandas()
    step3 = frame[(frame.step == 3) & frame["mask"]]

    by_position = step3.groupby("token_index")
    top, middle, _ = plots.position_curves(gae_trace, 3).axes
    drawn = {line.get_label(): line.get_xydata() for line in top.lines + middle.lines}
    for label, column in (("value V(s_t)", "value"), ("return (critic target)", "return"), ("advantage (trained on)", "advantage")):
        expected = by_position[column].mean()
        np.testing.assert_allclose(drawn[label][:, 0], expected.index.to_numpy())
        np.testing.assert_allclose(drawn[label][:, 1], expected.to_numpy(), rtol=1e-6)

    points = plots.value_vs_return(gae_trace, 3).axes[0].collections[0].get_offsets()
    np.testing.assert_allclose(np.asarray(points), step3[["value", "return"]].to_numpy(), rtol=1e-6)

    per_sample = frame[frame["mask"]].groupby(["step", "sample"])["score"].sum().groupby("step").mean()
    score_line = plots.over_steps(gae_trace).axes[0].lines[0].get_xydata()
    np.testing.assert_allclose(score_line, np.column_stack([per_sample.index, per_sample.to_numpy()]), rtol=1e-6)

    heatmap = plots.advantage_heatmap(gae_trace, 3, sample=1)
    shown = [t.get_text() for t in heatmap.axes[0].texts if re.fullmatch(r"[+-]\d+\.\d\d", t.get_text())]
    sample1 = frame[(frame.step == 3) & (frame["sample"] == 1) & frame["mask"]]
    assert shown == [f"{a:+.2f}" for a in sample1["advantage"]]


@pytest.mark.parametrize("response_tokens", [1, 3])
def test_the_heatmaps_title_and_footnote_stay_inside_the_figure(monkeypatch, tmp_path, char_tokenizer, response_tokens):
    """A short response under a long prompt of CJK characters drawn as code points (no CJK font):
    every line of the title and of the footnote lies within the saved figure."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    monkeypatch.setattr(plots, "_candidate_fonts", lambda: [])
    b = by_verl_gae(random_batch(1, B=2, T=3, interior=False), 1.0, 1.0)
    prompt = "请问12+34=46？是的，等于！" * 4  # 68 characters, 36 of them drawn as U+XXXX
    b = replace(b, prompts=torch.tensor([token_ids(prompt)] * 2), prompt_mask=torch.ones(2, len(prompt), dtype=torch.bool))
    b.mask[0, response_tokens:] = 0
    path = write_trace(tmp_path / "t", algorithm("gae"), {1: b}, tokenizer_path=char_tokenizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FontFallbackWarning)
        fig = advantage_heatmap(path, sample=0)
    canvas = FigureCanvasAgg(fig)
    fig.savefig(io.BytesIO(), format="png", dpi=130)  # the layout as saved
    renderer = canvas.get_renderer()
    texts = [fig._suptitle, fig._supxlabel]
    assert all(text is not None for text in texts) and "U+8BF7" in fig._suptitle.get_text()
    for text in texts:
        box = text.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= fig.bbox.width and 0 <= box.y0 and box.y1 <= fig.bbox.height, text.get_text()


# ------------------------------------------------------------------ the off-policy figure


def _offpolicy_expected(path: str):
    """From the token table with pandas: per step the quantiles of |old − rollout| over the policy's own
    tokens (mask or rejected); per (step, decile of a response's own tokens, ⌊10·i/L⌋) the same, the
    rejected share and the mean weight."""
    import numpy as np

    from verl_ext.trace.reader import open_trace

    frame = open_trace(path).to_pandas()
    own = frame[frame["mask"] | frame["rejected"].fillna(False).astype(bool)].copy()
    own["gap"] = (own["old_log_prob"].astype("float64") - own["rollout_log_prob"].astype("float64")).abs()
    rank = own.groupby(["step", "sample"]).cumcount()
    length = own.groupby(["step", "sample"])["gap"].transform("size")
    own["decile"] = (10 * rank) // length
    quantiles = {"p50": lambda g: np.quantile(g, 0.5), "p99": lambda g: np.quantile(g, 0.99), "max": np.max}
    per_step = {label: own.groupby("step")["gap"].agg(q) for label, q in quantiles.items()}
    per_decile = {label: own.groupby(["step", "decile"])["gap"].agg(q) for label, q in quantiles.items()}
    return own, per_step, per_decile


def test_the_offpolicy_figure_draws_the_gap_per_step_and_by_position_with_the_correction(tmp_path):
    """On verl's own weights and rejection (tests/inspect/test_check_correction.py's trace): the top
    panel's lines are each step's p50, p99, max of |ℓ|, on a log scale; below, at the step, the same
    per decile of each response's own tokens, and the rejected share (bars) and mean weight (line)."""
    import numpy as np

    from tests.inspect.test_check_correction import CASES, corrected_trace

    path = corrected_trace(tmp_path, CASES["token TIS, token_k1"])
    own, per_step, per_decile = _offpolicy_expected(path)
    step = 1
    fig = plots.offpolicy_gap(path, step)
    steps, gap, correction, weights = fig.axes
    assert steps.get_yscale() == "log" and gap.get_yscale() == "log"
    drawn = {line.get_label(): line.get_xydata() for line in steps.lines}
    by_decile = {line.get_label(): line.get_xydata() for line in gap.lines}
    deciles = own[own.step == step].groupby("decile")
    assert list(deciles.groups) == list(range(10))  # every decile has tokens: 10 points each
    for label in ("p50", "p99", "max"):
        np.testing.assert_allclose(drawn[f"|ℓ| {label}"], np.column_stack([per_step[label].index, per_step[label].to_numpy()]), rtol=1e-12)
        np.testing.assert_allclose(by_decile[f"|ℓ| {label}"], np.column_stack([range(10), per_decile[label][step].to_numpy()]), rtol=1e-12)
    assert (drawn["|ℓ| p50"][:, 1] < drawn["|ℓ| p99"][:, 1]).all() and (drawn["|ℓ| p99"][:, 1] <= drawn["|ℓ| max"][:, 1]).all()
    heights = [bar.get_height() for bar in correction.patches]
    np.testing.assert_allclose(heights, deciles["rejected"].mean().to_numpy(), rtol=1e-12)
    assert 0 < min(heights) and max(heights) < 1  # this case rejects some tokens of each decile
    (weight_line,) = [line for line in weights.lines if line.get_label() == "mean importance weight"]
    np.testing.assert_allclose(weight_line.get_ydata(), deciles["rollout_is_weight"].mean().to_numpy(), rtol=1e-6)
    assert [t.get_text() for t in correction.get_legend().get_texts()] == ["rejected share", "mean importance weight"]


def test_the_offpolicy_figure_is_drawn_only_where_the_rollouts_log_probs_are(gae_trace, tmp_path, run_cli):
    """verl-ext plot draws it for a run with rollout log-probs (without a correction: the gap alone), not
    for one without (gae_trace: test_plot_command_writes_every_figure lists its figures), and the
    function says why; a gap of 0 on every token (bypass mode) is said, not drawn on the log scale."""
    import numpy as np

    from verl_ext.errors import UsageError

    with pytest.raises(UsageError, match="no step has the rollout's log-probs"):
        plots.offpolicy_gap(gae_trace)
    batches = {}
    for step in (1, 2):
        b = by_verl_gae(random_batch(step, kl_coef=0.05), 1.0, 0.95)
        old = -torch.rand(b.mask.shape, generator=torch.Generator().manual_seed(step)) * 3
        batches[step] = replace(b, old_log_prob=old, rollout_log_prob=old + 1e-3 * torch.linspace(-1, 1, b.mask.numel()).reshape(b.mask.shape))
    path = write_trace(tmp_path / "gap", algorithm("gae", lam=0.95, kl="kl"), batches)
    code, out, _ = run_cli("plot", path, "--out", str(tmp_path / "plots"))
    assert code == 0 and out.splitlines()[-1].endswith("/offpolicy_step2.png")
    with open(out.splitlines()[-1], "rb") as png:
        assert png.read(8) == PNG_SIGNATURE
    _, per_step, _ = _offpolicy_expected(path)
    fig = plots.offpolicy_gap(path)
    assert len(fig.axes) == 2  # no correction: no panel of it
    np.testing.assert_allclose(fig.axes[0].lines[2].get_ydata(), per_step["max"].to_numpy(), rtol=1e-12)
    same = {step: replace(b, rollout_log_prob=b.old_log_prob) for step, b in batches.items()}
    fig = plots.offpolicy_gap(write_trace(tmp_path / "bypass", algorithm("gae", lam=0.95, kl="kl"), same))
    for axis in fig.axes:
        assert len(axis.lines) == 0 and any("|ℓ| = 0 on every token" in t.get_text() for t in axis.texts)
