import warnings
from dataclasses import replace

import pytest
import torch
from tests.inspect.inspect_helpers import algorithm, by_verl_gae, random_batch, token_ids, write_trace

from verl_ext.inspect import fonts
from verl_ext.inspect.plots import FontFallbackWarning, PlotNote, advantage_heatmap, save_plots

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
    ]
    for line in out.splitlines():
        with open(line, "rb") as png:
            assert png.read(8) == PNG_SIGNATURE
    # random ids 7…19 decode to the tokenizer's digits and punctuation only: no font note
    assert "U+" not in err


def test_figures_that_do_not_apply_are_left_out_with_a_note(tmp_path):
    b = random_batch(1)
    b = replace(b, values=None, returns=b.scores, advantages=b.scores, advantage_raw=None)
    path = write_trace(tmp_path / "t", algorithm("grpo"), {1: b})
    with pytest.warns(PlotNote, match="value_vs_return_step1.png left out: step 1 has no values"):
        written = save_plots(path, tmp_path / "plots")
    assert [p.name for p in written] == ["positions_step1.png", "over_steps.png", "advantages_step1_sample0.png"]


def test_cjk_without_a_cjk_font_falls_back_to_code_points_and_says_so(monkeypatch, tmp_path, char_tokenizer):
    monkeypatch.setattr(fonts, "_candidate_fonts", lambda: [])  # as on a machine without CJK fonts
    font = fonts.label_font(["是的", "2！"])
    assert font.missing == {"是", "的", "！"}
    assert font.label("是的2！") == "U+662F U+7684 2 U+FF01"
    assert font.label("是") == "U+662F"
    assert "install a CJK font" in font.note
    assert fonts.label_font(["Жизнь", "αβγ"]).missing == frozenset()  # DejaVu Sans draws these

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
