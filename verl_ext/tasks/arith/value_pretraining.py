"""The arithmetic task's value pretraining: the warm start's own answers, scored, and where the
critic is measured (:mod:`verl_ext.tasks.value_pretraining` trains it).

The warm-started policy answers every training row once (temperature 1); each response is scored
(:func:`verl_ext.tasks.arith.task.score_response`). The critic is kept at the epoch whose held-out
explained variance after the verdict (the validation prompts, 8 samples each) is best.

Why it is needed: after the verdict the outcome is decided, but to see it the critic must build a
feature the warm start does not have ("does the verdict match whether c = a+b?"). Inside RL it
never does: the actor soon makes wrong verdicts rare, and without them there is nothing to learn
from (issue 15's investigation). Here about a third of the verdicts are wrong (36% with the
default assets), and a few hundred updates at lr 3e-4 learn it.
"""

from __future__ import annotations

from verl_ext.tasks.arith.task import VERDICT_MARK, Problem, score_response, verdict_index
from verl_ext.tasks.arith.warm_start import prompt_ids
from verl_ext.tasks.common import left_padded
from verl_ext.tasks.value_pretraining import ScoredResponses, ValuePretrainingSettings
from verl_ext.torch_threads import one_torch_thread


def pretrain_value(policy, tokenizer, train: list[Problem], val: list[Problem], settings: ValuePretrainingSettings, seed: int):
    """Sample and score the warm start's answers (one per training row, ``held_out_samples`` per
    validation prompt), then train the critic on them; return (critic, report): the report of
    :func:`verl_ext.tasks.value_pretraining.pretrain_value` with ``wrong_verdicts``, the share of
    wrong verdicts among the training responses."""
    from verl_ext.tasks import value_pretraining

    train_set, wrong_verdicts = scored_responses(policy, tokenizer, train, samples=1, seed=seed)
    held_out, _ = scored_responses(policy, tokenizer, val, samples=settings.held_out_samples, seed=seed + 1)
    critic, report = value_pretraining.pretrain_value(policy, train_set, held_out, settings, seed, select_by="after_verdict")
    return critic, {**report, "wrong_verdicts": wrong_verdicts}


def verdict_states(response: list[int], verdict: int | None) -> dict[str, list[int]]:
    """``before_verdict``: the states up to the one that chooses the verdict (t ≤ verdict);
    ``after_verdict``: those that have seen it (t > verdict); both empty without a verdict."""
    if verdict is None:
        return {"after_verdict": [], "before_verdict": []}
    return {"after_verdict": list(range(verdict + 1, len(response))), "before_verdict": list(range(verdict + 1))}


def scored_responses(policy, tokenizer, problems: list[Problem], samples: int, seed: int) -> tuple[ScoredResponses, float]:
    """``samples`` sampled answers per problem (temperature 1, at most 12 tokens, seeded), scored,
    with the states before and after each verdict (:func:`verdict_states`); and the share of wrong
    verdicts among the responses that have one."""
    import torch

    prompts = [prompt_ids(tokenizer, p) for p in problems for _ in range(samples)]
    expected = [p.answer() for p in problems for _ in range(samples)]
    input_ids, attention_mask, _ = left_padded([(p, []) for p in prompts], tokenizer.pad_token_id)
    torch.manual_seed(seed)
    with torch.no_grad(), one_torch_thread():
        output = policy.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=12, do_sample=True,
            temperature=1.0, top_k=0, top_p=None, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    rows, scores, states, judged = [], [], {"after_verdict": [], "before_verdict": []}, []
    mark = tokenizer.convert_tokens_to_ids(VERDICT_MARK)
    for prompt, generated, answer in zip(prompts, output[:, input_ids.shape[1] :].tolist(), expected):
        response = generated[: generated.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in generated else generated
        response = [t for t in response if t != tokenizer.pad_token_id] or [tokenizer.eos_token_id]
        score = score_response(tokenizer.decode(response, skip_special_tokens=True), answer)
        verdict = verdict_index(response, mark, tokenizer.eos_token_id)
        rows.append((prompt, response, [1.0] * len(response)))
        scores.append(score.score)
        for name, positions in verdict_states(response, verdict).items():
            states[name].append(positions)
        if verdict is not None:
            judged.append(score.verdict_right)
    wrong_verdicts = round(1 - sum(judged) / max(len(judged), 1), 3)
    return ScoredResponses(rows, scores, tokenizer.pad_token_id, states), wrong_verdicts
