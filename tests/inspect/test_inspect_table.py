"""The per-token table (``verl-ext show``): numbers, decoded tokens, terminal/CSV/Markdown output."""

import numpy as np
import pyarrow as pa
import pytest
import torch
from tests.inspect.inspect_helpers import EOS, Batch, algorithm, by_definition, token_ids, write_trace

from verl_ext.errors import UsageError
from verl_ext.inspect.render import display_width, render
from verl_ext.inspect.table import CONTINUATION, TokenDecoder, sample_view, visible

# The seed example with the character-level tokenizer: 是 的 ， 等 于 2 ！ </s>
RESPONSE_IDS = token_ids("是的，等于2！") + [EOS]
PROMPT_IDS = token_ids("请问1+1=2？")
ID = RESPONSE_IDS[0]  # 是


def worked_example_trace(directory, tokenizer_path: str = "") -> str:
    """docs/definitions.md §5: r = [0, 0, 1], V = [0.3, 0.4, 0.6], γ = 1, GAE λ = 0.95, no whitening;
    the three tokens are the first three of the seed response; one interior masked token (t=1)."""
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    scores = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.3, 9.0, 0.4, 0.6]])  # 9.0: junk at the masked position
    b = Batch(mask, torch.tensor([RESPONSE_IDS[:4]]), torch.tensor([PROMPT_IDS]), torch.ones(1, 8, dtype=torch.bool),
              scores, None, scores.clone(), values)  # fmt: skip
    b = by_definition(b, "gae_ext", gamma=1.0, lam=0.95, whitened=False)
    return write_trace(
        directory, algorithm("gae_ext", lam=0.95, whiten_advantages=False), {1: b}, tokenizer_path=tokenizer_path
    )


def test_table_holds_the_worked_example(tmp_path):
    table = sample_view(worked_example_trace(tmp_path / "t"), 1, 0, TokenDecoder()).table.to_pydict()
    assert table["t"] == [0, 1, 2, 3]
    assert table["mask"] == [True, False, True, True]
    assert table["token"] == [f"#{i}" for i in RESPONSE_IDS[:4]]
    valid = [0, 2, 3]
    assert [table["delta"][i] for i in valid] == pytest.approx([0.1, 0.2, 0.4], abs=1e-6)
    assert table["delta"][1] is None  # no δ on a masked token
    assert [table["return"][i] for i in valid] == pytest.approx([0.951, 0.98, 1.0], abs=1e-6)
    assert [table["advantage_raw"][i] for i in valid] == pytest.approx([0.651, 0.58, 0.4], abs=1e-6)
    assert table["advantage"] == table["advantage_raw"]
    assert table["kl"] == [None] * 4


def test_per_turn_rewards_are_shown_where_the_run_placed_them(tmp_path):
    """The worked example with a tool reward of 0.1 on turn 0's last token (t = 0, before the hole)."""
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    scores = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    tool_reward, turn_score = torch.tensor([[0.1, 0.0, 0.0, 0.0]]), torch.zeros(1, 4)
    b = Batch(mask, torch.tensor([RESPONSE_IDS[:4]]), torch.tensor([PROMPT_IDS]), torch.ones(1, 8, dtype=torch.bool),
              scores, None, scores + tool_reward, torch.tensor([[0.3, 9.0, 0.4, 0.6]]), turn_score=turn_score, tool_reward=tool_reward)  # fmt: skip
    b = by_definition(b, "gae_ext", gamma=1.0, lam=0.95, whitened=False)
    path = write_trace(tmp_path / "t", algorithm("gae_ext", lam=0.95, whiten_advantages=False), {1: b})
    table = sample_view(path, 1, 0, TokenDecoder()).table
    assert table.column_names[6:11] == ["score", "turn_score", "tool_reward", "kl", "reward"]
    assert table.column("tool_reward").to_pylist() == pytest.approx([0.1, 0.0, 0.0, 0.0])
    assert [table.column("reward")[i].as_py() for i in (0, 2, 3)] == pytest.approx([0.1, 0.0, 1.0])


def test_decoded_tokens_and_text(tmp_path, char_tokenizer):
    view = sample_view(worked_example_trace(tmp_path / "t", char_tokenizer), 1, 0)  # the record's tokenizer
    assert view.table.column("token").to_pylist() == ["是", "的", "，", "等"]
    assert view.prompt_text == "请问1+1=2？"
    assert view.response_text == "是⟦的⟧，等"  # a token the policy did not write (mask 0) inline, marked


def test_a_character_split_over_byte_tokens_is_shown_once():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    ids = tokenizer("是的 2\n")["input_ids"]
    assert len(ids) == 9  # 3 + 3 UTF-8 bytes, space, 2, newline
    assert TokenDecoder(tokenizer).pieces(ids) == [
        "是",
        CONTINUATION,
        CONTINUATION,
        "的",
        CONTINUATION,
        CONTINUATION,
        "␣",
        "2",
        "\\n",
    ]


def test_visible_escapes_what_a_terminal_would_hide():
    assert visible(" a\tb\n\x00") == "␣a\\tb\\n\\u0000"
    assert visible("请问 1", show_spaces=False) == "请问 1"


def test_terminal_text_aligns_cjk_by_display_width(tmp_path, char_tokenizer):
    view = sample_view(worked_example_trace(tmp_path / "t"), 1, 0, char_tokenizer)
    lines = render(view.table, "text").splitlines()
    assert lines[0].split() == [
        "t",
        "token_id",
        "token",
        "mask",
        "turn",  # the hole at t = 1 makes two assistant turns
        "role",
        "score",
        "reward",
        "value",
        "delta",
        "return",
        "advantage_raw",
        "advantage",
    ]  # fmt: skip  (kl: null everywhere, dropped)
    assert len({display_width(line) for line in lines}) == 1  # every row as wide as the header
    assert lines[1].split()[:7] == ["0", str(ID), "是", "1", "0", "assistant", "0.0000"]
    assert display_width("是的2") == 5
    assert render(pa.table({"x": [-1e-9, -0.5]}), "text", digits=2).split() == ["x", "0.00", "-0.50"]


def test_csv_and_markdown(tmp_path):
    view = sample_view(worked_example_trace(tmp_path / "t"), 1, 0, TokenDecoder())
    csv_lines = render(view.table, "csv").splitlines()
    assert csv_lines[0] == "t,token_id,token,mask,turn,role,score,kl,reward,value,delta,return,advantage_raw,advantage"
    # each float as the shortest text that reads back as the same float32 (0.3 − 0.3f32 rounding shows)
    assert csv_lines[1] == f"0,{ID},#{ID},true,0,assistant,0.0,,0.0,0.3,0.099999994,0.951,0.65099996,0.65099996"
    assert [line.split(",")[4] for line in csv_lines[1:]] == ["0", "0", "1", "1"]  # the hole keeps turn 0
    # the model's tokens are the assistant's; no agent loop said who wrote the hole's
    assert [line.split(",")[5] for line in csv_lines[1:]] == ["assistant", "", "assistant", "assistant"]
    assert np.float32(csv_lines[1].split(",")[-1]) == view.table.column("advantage")[0].as_py()
    markdown = render(view.table, "markdown", digits=3).splitlines()
    assert markdown[1].startswith("|---:|---:|:---|:---|---:|:---|---:|")
    assert markdown[2] == f"| 0 | {ID} | #{ID} | 1 | 0 | assistant | 0.000 | 0.000 | 0.300 | 0.100 | 0.951 | 0.651 | 0.651 |"


def test_unknown_step_or_sample_is_a_usage_error(tmp_path):
    path = worked_example_trace(tmp_path / "t")
    with pytest.raises(UsageError, match="has no step 7"):
        sample_view(path, 7, 0, TokenDecoder())
    with pytest.raises(UsageError, match=r"step 1 has no sample 3 \(traced samples: 0\)"):
        sample_view(path, 1, 3, TokenDecoder())


def test_show_command(tmp_path, char_tokenizer, run_cli):
    path = worked_example_trace(tmp_path / "t", char_tokenizer)
    code, out, err = run_cli("show", path, "--step", "1", "--sample", "0")
    assert code == 0 and err == ""
    assert "prompt:   请问1+1=2？" in out
    assert "response: 是⟦的⟧，等" in out
    assert "gae_ext(γ=1, λ=0.95), not whitened, no KL in reward" in out
    assert "0.6510" in out

    code, out, err = run_cli("show", path, "--format", "csv", "--tokenizer", str(tmp_path / "nowhere"))
    assert code == 0
    assert out.splitlines()[1].startswith(f"0,{ID},#{ID},true,")
    assert err.startswith("note: cannot load tokenizer") and err.count("\n") == 1

    code, out, err = run_cli("show", path, "--sample", "5")
    assert code == 2 and out == ""
    assert err == "verl-ext show: step 1 has no sample 5 (traced samples: 0)\n"


# --------------------------------------------------------------------------- show --with-tool-call

#: Per step, each sample's agent-loop record (None: the loop said nothing): step 1's first response that
#: called a tool is sample 2 (sample 0 answered at once, sample 1's loop did not say); no response of
#: step 2 called one.
TOOL_CALLS = {1: [0, None, 1, 2], 2: [0, 0, 0, 0]}


def tool_trace(directory, records: bool = True) -> str:
    """Two steps of four responses; ``records``: the agent loop's records of TOOL_CALLS (else none at all,
    as a run without an agent loop, or a trace before format 5, has)."""
    from verl_ext.options import TraceOptions
    from verl_ext.trace.capture import StepCapture
    from verl_ext.trace.schema import RunRecord
    from verl_ext.trace.writer import TraceWriter

    mask = torch.tensor([[1, 1, 1]] * 4)
    score = torch.zeros(4, 3)
    options = TraceOptions(dir=str(directory))
    record = RunRecord(
        verl_ext_version="test", verl_version="0.9.1", trainer="legacy", created_at="2026-01-01T00:00:00+00:00",
        algorithm=algorithm("grpo"), model_path="", tokenizer_path="", rollout_n=2, trace=options.as_dict(),
    )  # fmt: skip
    with TraceWriter(options, record) as writer:
        for step, calls in TOOL_CALLS.items():
            agent_turns = [None if n is None else {"roles": [["assistant", 3]], "tool_calls": n, "turn_limit": False} for n in calls]
            writer.submit(StepCapture(
                step=step, mask=mask, token_id=torch.full((4, 3), 7), uid=["g0", "g0", "g1", "g1"],
                floats={"score": score, "reward": score, "advantage": score}, prompts=torch.full((4, 2), 8),
                agent_turns=agent_turns if records else None,
            ))  # fmt: skip
    return str(directory)


def test_show_with_tool_call_shows_the_first_response_that_called_a_tool(tmp_path, run_cli):
    path = tool_trace(tmp_path / "t")
    code, out, _ = run_cli("show", path, "--step", "1", "--with-tool-call")
    assert code == 0 and out.startswith("step 1 · sample 2 · uid g1 ·")


def test_show_with_tool_call_says_in_one_line_when_no_response_called_one(tmp_path, run_cli):
    path = tool_trace(tmp_path / "t")
    code, out, err = run_cli("show", path, "--with-tool-call")  # the last step: step 2
    assert (code, out) == (2, "")
    assert err == "verl-ext show: no response of step 2 called a tool (0 tool calls in its 4 responses)\n"
    code, out, err = run_cli("show", tool_trace(tmp_path / "unsaid", records=False), "--step", "1", "--with-tool-call")
    assert (code, out) == (2, "")
    assert err == (
        "verl-ext show: step 1 records no tool calls: no agent loop said how many (a run without tools, or a trace before format 5)\n"
    )


def test_show_takes_a_sample_or_the_first_with_a_tool_call_not_both(tmp_path, run_cli, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("show", tool_trace(tmp_path / "t"), "--with-tool-call", "--sample", "1")
    assert exit_info.value.code == 2
    assert "argument --sample: not allowed with argument --with-tool-call" in capsys.readouterr().err
