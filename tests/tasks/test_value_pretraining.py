"""Value pretraining's pieces, by hand: where V(s_t) is read from, the loss, the held-out fit split
at the verdict, and the scored responses of the warm start (verl_ext.tasks.value_pretraining,
verl_ext.tasks.arith.value_pretraining)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl_ext.tasks.arith.value_pretraining import scored_responses, verdict_states
from verl_ext.tasks.value_pretraining import ScoredResponses, held_out_fit, value_loss, values

PAD = 0


class StubCritic(torch.nn.Module):
    """A 'critic' whose head output is a known function of the input: ``head(token id, position id)``."""

    def __init__(self, head):
        super().__init__()
        self.head = head
        self.calls = []

    def forward(self, input_ids, attention_mask, position_ids):
        self.calls.append((input_ids.clone(), attention_mask.clone(), position_ids.clone()))
        return SimpleNamespace(logits=self.head(input_ids, position_ids).float()[..., None])


#: Three rows of different prompt and response lengths, so that each is left-padded differently.
ROWS = [
    ([11, 12, 13], [21, 22]),
    ([14, 15], [23, 24, 25, 26]),
    ([16], [27]),
]


def expected_value(prompt: list[int], response: list[int], t: int) -> float:
    """V(s_t) of the stub ``100·token + position``: read at the token before response token t,
    whose position (no padding counted) is len(prompt) + t − 1."""
    sequence = prompt + response
    before = len(prompt) + t - 1
    return 100.0 * sequence[before] + before


def test_values_are_the_head_output_one_position_before_each_response_token():
    from verl_ext.tasks.common import left_padded

    critic = StubCritic(lambda ids, positions: 100 * ids + positions)
    input_ids, attention_mask, response_mask = left_padded(ROWS, PAD)
    predicted = values(critic, input_ids, attention_mask, response_mask)

    width = max(len(p) + len(r) for p, r in ROWS)  # 6
    assert predicted.shape == (3, width)
    for row, (prompt, response) in enumerate(ROWS):
        expected = [0.0] * (width - len(response)) + [expected_value(prompt, response, t) for t in range(len(response))]
        assert predicted[row].tolist() == expected, row
    # the model saw left padding masked out and positions that start at 0 on the first real token
    (_, mask_seen, positions_seen), = critic.calls
    assert mask_seen.tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1]]
    assert positions_seen[0, 1:].tolist() == [0, 1, 2, 3, 4] and positions_seen[2, 4:].tolist() == [0, 1]


def responses(rows, scores, verdicts) -> ScoredResponses:
    states = [verdict_states(response, verdict) for (_, response), verdict in zip(rows, verdicts)]
    return ScoredResponses(
        rows=[(prompt, response, [1.0] * len(response)) for prompt, response in rows], scores=scores, pad_id=PAD,
        states={name: [s[name] for s in states] for name in ("after_verdict", "before_verdict")},
    )  # fmt: skip


def test_value_loss_is_half_the_mean_squared_error_over_response_tokens():
    critic = StubCritic(lambda ids, positions: ids / 10 + positions / 100)
    batch = responses(ROWS, [1.0, 0.2, 0.0], [None] * 3)
    squared = []
    for (prompt, response), score in zip(ROWS, batch.scores):
        sequence = prompt + response
        for t in range(len(response)):
            before = len(prompt) + t - 1
            squared.append((sequence[before] / 10 + before / 100 - score) ** 2)
    assert float(value_loss(critic, batch)) == pytest.approx(0.5 * np.mean(squared), rel=1e-6)


def ev(values, returns) -> float:
    values, returns = np.asarray(values, np.float64), np.asarray(returns, np.float64)
    return 1 - np.var(returns - values, ddof=1) / np.var(returns, ddof=1)


def test_fit_splits_the_states_at_the_verdict():
    """after = response positions t > verdict (they have seen it), before = t ≤ verdict; a response
    without a verdict counts in neither, but in the mean absolute error."""
    lookup = torch.rand(40, generator=torch.Generator().manual_seed(0))
    critic = StubCritic(lambda ids, positions: lookup[ids])
    rows = [
        ([1, 2], [5, 6, 7, 8, 9]),
        ([1, 3, 4], [10, 11, 12, 13]),
        ([2], [14, 15, 16, 17, 18, 19]),
        ([3, 4], [20, 21, 22]),
        ([1, 2], [23, 24, 25, 26]),  # no verdict
        ([4], [27, 28, 29, 30, 31]),
    ]
    scores = [1.0, 0.2, 0.4, 0.0, 0.2, 1.0]
    verdicts = [2, 1, 3, 0, None, 4]
    after, before, errors = ([], []), ([], []), []
    for (prompt, response), score, verdict in zip(rows, scores, verdicts):
        sequence = prompt + response
        for t in range(len(response)):
            value = float(lookup[sequence[len(prompt) + t - 1]])
            errors.append(abs(value - score))
            if verdict is not None:
                side = after if t > verdict else before
                side[0].append(value), side[1].append(score)
    assert len(after[0]) == 2 + 2 + 2 + 2 + 0 and len(before[0]) == 3 + 2 + 4 + 1 + 5

    fit = held_out_fit(critic, responses(rows, scores, verdicts))
    assert fit["ev_after_verdict"] == pytest.approx(ev(*after), abs=6e-5)
    assert fit["ev_before_verdict"] == pytest.approx(ev(*before), abs=6e-5)
    assert fit["mean_abs_error"] == pytest.approx(np.mean(errors), abs=6e-5)
    assert fit["ev_after_verdict"] != pytest.approx(fit["ev_before_verdict"], abs=1e-3)  # the split matters here


def test_a_tool_answer_is_neither_trained_nor_measured():
    """Mask-0 tokens (a tool's answer) carry no loss: the loss equals the one over the written tokens alone."""
    critic = StubCritic(lambda ids, positions: ids / 10 + positions / 100)
    prompt, response, mask = [11, 12], [21, 22, 23, 24, 25], [1.0, 1.0, 0.0, 0.0, 1.0]
    batch = ScoredResponses([(prompt, response, mask)], [1.0], PAD, {})
    sequence = prompt + response
    squared = [(sequence[len(prompt) + t - 1] / 10 + (len(prompt) + t - 1) / 100 - 1.0) ** 2 for t in (0, 1, 4)]
    assert float(value_loss(critic, batch)) == pytest.approx(0.5 * np.mean(squared), rel=1e-6)


def test_scored_responses_of_the_warm_start(assets):
    """Each row: the chat prompt, the sampled answer up to and with its EOS, the task's score of the
    decoded answer, the verdict token after the first "，"."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_ext.tasks.arith.assets import AssetSpec, task_problems, token_id
    from verl_ext.tasks.arith.task import score_response
    from verl_ext.tasks.arith.warm_start import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    policy = AutoModelForCausalLM.from_pretrained(assets.model_dir, dtype=torch.float32)
    problems = task_problems(AssetSpec())[1][:6]  # held-out problems
    scored, wrong_share = scored_responses(policy, tokenizer, problems, samples=2, seed=0)
    eos, comma = tokenizer.eos_token_id, token_id("，")
    assert len(scored.rows) == 12 and scored.pad_id == tokenizer.pad_token_id
    with_verdict, wrong = 0, 0
    for i, (prompt, response, mask) in enumerate(scored.rows):
        problem = problems[i // 2]
        assert prompt == prompt_ids(tokenizer, problem)
        assert tokenizer.pad_token_id not in response
        assert (response[-1] == eos and eos not in response[:-1]) or (len(response) == 12 and eos not in response)
        assert mask == [1.0] * len(response)
        expected = score_response(tokenizer.decode(response, skip_special_tokens=True), problem.answer())
        assert scored.scores[i] == expected.score
        verdict = None
        if comma in response:
            after = response.index(comma) + 1
            verdict = after if after < len(response) and response[after] != eos else None
        assert scored.states["after_verdict"][i] == ([] if verdict is None else list(range(verdict + 1, len(response))))
        assert scored.states["before_verdict"][i] == ([] if verdict is None else list(range(verdict + 1)))
        with_verdict += verdict is not None
        wrong += verdict is not None and not expected.verdict_right
    assert with_verdict >= 10  # the warm start writes "等于<sum>，<verdict>！"
    assert wrong_share == pytest.approx(wrong / with_verdict, abs=1e-3)
    assert scored_responses(policy, tokenizer, problems, samples=2, seed=0)[0].rows == scored.rows  # seeded
