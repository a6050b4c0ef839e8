"""The browser view of a multi-turn step, in real headless chromium: a tool's tokens drawn as such
(labelled with their role, never coloured by a quantity), assistant turns marked where they begin,
and the responses that call a tool listed apart from those that do not. Expected values come from
the agent-loop records written into the trace here, by hand."""

from __future__ import annotations

import torch

from tests.view.test_view_page import show, url
from tests.view.view_helpers import VOCAB
from verl_ext import cli

#: Per sample: the response mask and the agent loop's record (None: the loop said nothing).
RESPONSES = [
    ([1, 1, 0, 0, 1, 1], {"roles": [["assistant", 2], ["tool", 2], ["assistant", 2]], "tool_calls": 1, "turn_limit": False}),
    ([1, 1, 1, 0, 0, 0], {"roles": [["assistant", 3]], "tool_calls": 0, "turn_limit": False}),
    ([1, 0, 0, 1, 0, 0], {"roles": [["assistant", 1], ["tool", 1], ["other", 1], ["assistant", 1]], "tool_calls": 1, "turn_limit": True}),
    ([1, 1, 1, 1, 0, 0], None),
]


def write_multi_turn_trace(directory, tokenizer: str) -> str:
    from tests.inspect.inspect_helpers import algorithm
    from verl_ext.options import TraceOptions
    from verl_ext.trace.capture import StepCapture
    from verl_ext.trace.schema import RunRecord
    from verl_ext.trace.writer import TraceWriter

    mask = torch.tensor([m for m, _ in RESPONSES])
    batch, length = mask.shape
    score = torch.zeros(batch, length)
    last = (mask * (torch.arange(length) + 1)).argmax(dim=1)
    score[torch.arange(batch), last] = torch.tensor([1.0, 0.2, 0.0, 0.4])
    advantage = torch.linspace(-1, 1, batch * length).reshape(batch, length) * mask
    tool_reward = torch.zeros(batch, length)
    tool_reward[0, 1] = tool_reward[2, 0] = 0.1  # the calling turn's last token (verl_ext.turn_rewards)
    options = TraceOptions(dir=str(directory))
    record = RunRecord(
        verl_ext_version="test", verl_version="0.9.1", trainer="legacy", created_at="2026-01-01T00:00:00+00:00",
        algorithm=algorithm("grpo"), model_path=tokenizer, tokenizer_path=tokenizer, rollout_n=2, trace=options.as_dict(),
    )  # fmt: skip
    with TraceWriter(options, record) as writer:
        writer.submit(StepCapture(
            step=1, mask=mask, token_id=torch.full((batch, length), VOCAB.index("x")), uid=["g0", "g0", "g1", "g1"],
            floats={"score": score, "reward": score + tool_reward, "advantage": advantage, "tool_reward": tool_reward}, prompts=torch.full((batch, 2), VOCAB.index("y")),
            agent_turns=[r for _, r in RESPONSES],
        ))  # fmt: skip
    return str(directory)


def test_tool_tokens_turns_and_the_tool_filters(tmp_path, piece_tokenizer, page):
    trace = write_multi_turn_trace(tmp_path / "trace", piece_tokenizer)
    out = tmp_path / "page.html"
    assert cli.main(["view", trace, "--out", str(out), "-q"]) == 0
    show(page, str(out), 1, 0, colour="advantage")
    tokens = page.evaluate(
        "[...document.querySelectorAll('#response .tok')].map(s => ({role: s.dataset.role || null, turn: s.dataset.turn,"
        " start: s.classList.contains('turn-start'), coloured: [...s.classList].some(c => /^c-?\\d+$/.test(c)), cls: s.className}))"
    )
    assert [t["role"] for t in tokens] == ["assistant", "assistant", "tool", "tool", "assistant", "assistant"]
    assert [t["turn"] for t in tokens] == ["0", "0", "0", "0", "1", "1"]
    assert [t["start"] for t in tokens] == [False, False, False, False, True, False]
    # the tool's tokens: marked as its, never coloured by the quantity (the policy's are)
    assert [t["coloured"] for t in tokens] == [True, True, False, False, True, True]
    assert all("masked role-tool" in t["cls"] for t in tokens[2:4])
    page.evaluate("document.querySelectorAll('#response .tok')[2].dispatchEvent(new MouseEvent('mouseover', {bubbles: true}))")
    assert "masked (not trained), written by: tool" in page.evaluate("document.getElementById('details').textContent")

    show(page, str(out), 1, 2)
    assert page.evaluate("[...document.querySelectorAll('#response .tok')].map(s => s.dataset.role)") == ["assistant", "tool", "other", "assistant"]
    for name, wanted in {"tool": [0, 2], "notool": [1]}.items():  # sample 3's loop said nothing: in neither
        page.goto(url(str(out), step=1, filter=name))
        page.wait(f"document.body.dataset.stats === '1' && location.hash.includes('filter={name}')", f"filter {name}")
        shown = page.evaluate("[...document.querySelectorAll('#sample-list a[data-sample]')].map(a => Number(a.dataset.sample))")
        assert shown == wanted, name


def test_a_tool_reward_can_colour_the_tokens(tmp_path, piece_tokenizer, page):
    """The per-turn rewards a run placed are a quantity of the colour menu; the one token that holds a
    tool reward is coloured apart from the other tokens of its response."""
    trace = write_multi_turn_trace(tmp_path / "trace", piece_tokenizer)
    out = tmp_path / "page.html"
    assert cli.main(["view", trace, "--out", str(out), "-q"]) == 0
    show(page, str(out), 1, 0, colour="tool_reward")
    assert page.evaluate("document.getElementById('colour').value") == "tool_reward"
    assert "turn_score" not in page.evaluate("[...document.querySelectorAll('#colour option')].map(o => o.value)")  # null: not offered
    classes = page.evaluate("[...document.querySelectorAll('#response .tok')].map(s => [...s.classList].find(c => /^c-?\\d+$/.test(c)) || null)")
    policy = [classes[i] for i in (0, 1, 4, 5)]
    assert policy[1] is not None and policy.count(policy[1]) == 1 and len(set(policy[:1] + policy[2:])) == 1
