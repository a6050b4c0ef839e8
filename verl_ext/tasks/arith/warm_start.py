"""The warm start: a short supervised fine-tune of the tiny model on the CPU task, as RLHF starts from SFT.

The fine-tune teaches the format and the sum. Its verdict carries a weak, documented prior: each
training answer has the right verdict with probability ``verdict_prior`` (0.7 by default) and the
wrong one otherwise, so the model's verdict is only a little better than a coin. Learning the
verdict is left to RL. (From a verdict at exactly chance, RL on this model barely moves within a
few hundred steps: a weak prior gives it a feature to grow.)

Deterministic given the seed: one CPU thread, seeded sampling of problems and verdicts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from verl_ext.tasks.arith.task import NO, YES, Problem, score_response
from verl_ext.tasks.common import fine_tune, left_padded
from verl_ext.torch_threads import one_torch_thread


@dataclass(frozen=True)
class WarmStartSettings:
    steps: int = 500
    batch_size: int = 64
    lr: float = 1e-3
    warmup_steps: int = 20
    verdict_prior: float = 0.7


@dataclass(frozen=True)
class Evaluation:
    """Shares of held-out responses: fully right, well-formed with the right sum, right verdict."""

    acc: float
    sum: float
    verdict: float
    responses: int


def supervised_fine_tune(model, tokenizer, problems: list[Problem], settings: WarmStartSettings, seed: int) -> float:
    """Fine-tune ``model`` in place on ``problems`` (cycled, shuffled); return the last loss.

    Each answer has the right verdict with probability ``settings.verdict_prior``.
    """

    def batch(rng: random.Random) -> list[tuple[list[int], list[int]]]:
        problems_ = [rng.choice(problems) for _ in range(settings.batch_size)]
        return [(prompt_ids(tokenizer, p), answer_ids(tokenizer, p, rng.random() < settings.verdict_prior)) for p in problems_]

    return fine_tune(model, tokenizer.pad_token_id, batch, settings, seed)


def evaluate(model, tokenizer, problems: list[Problem], *, samples: int = 1, greedy: bool = True, seed: int = 0) -> Evaluation:
    """Generate for each problem (greedy, or ``samples`` samples at temperature 1) and score the answers."""
    import torch

    prompts = [prompt_ids(tokenizer, p) for p in problems for _ in range(1 if greedy else samples)]
    expected = [p.answer() for p in problems for _ in range(1 if greedy else samples)]
    input_ids, attention_mask, _ = left_padded([(p, []) for p in prompts], tokenizer.pad_token_id)
    torch.manual_seed(seed)
    with torch.no_grad(), one_torch_thread():
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=12,
            do_sample=not greedy,
            temperature=None if greedy else 1.0,
            top_k=None if greedy else 0,
            top_p=None,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    texts = tokenizer.batch_decode(output[:, input_ids.shape[1] :], skip_special_tokens=True)
    scores = [score_response(text, answer) for text, answer in zip(texts, expected)]
    return Evaluation(
        acc=sum(s.acc for s in scores) / len(scores),
        sum=sum(s.sum_right for s in scores) / len(scores),
        verdict=sum(s.verdict_right for s in scores) / len(scores),
        responses=len(scores),
    )


def prompt_ids(tokenizer, problem: Problem) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.question()}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)


def answer_ids(tokenizer, problem: Problem, right_verdict: bool) -> list[int]:
    """The answer with the right verdict or the wrong one, and EOS."""
    answer = problem.answer()
    if not right_verdict:
        answer = answer.replace(YES, NO) if problem.right else answer.replace(NO, YES)
    return tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
