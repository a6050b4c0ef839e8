"""The warm start: a short supervised fine-tune of the tiny model on the CPU task, as RLHF starts from SFT.

The fine-tune teaches the format and the sum. Its verdict carries a weak, documented prior: each
training answer has the right verdict with probability ``verdict_prior`` (0.7 by default) and the
wrong one otherwise, so the model's verdict is only a little better than a coin. Learning the
verdict is left to RL. (From a verdict at exactly chance, RL on this model barely moves within a
few hundred steps: a weak prior gives it a feature to grow.)

Deterministic given the seed: one CPU thread, seeded sampling of problems and verdicts.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from verl_ext.tasks.arith.task import NO, YES, Problem, score_response
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


def fine_tune(model, pad_id: int, batch, settings, seed: int) -> float:
    """Fine-tune ``model`` in place for ``settings.steps`` steps on ``batch(rng)`` (a list of rows
    ``(prompt_ids, response_ids)`` or ``(prompt_ids, response_ids, loss_mask)``); return the last loss.

    Loss: mean negative log-likelihood of the response tokens with loss (all of them when a row has
    no ``loss_mask``). Adam, linear warm-up then cosine decay to 0.1 of ``settings.lr``, gradient
    norm clipped at 1.
    """
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    model.train()
    loss = torch.tensor(float("nan"))
    with one_torch_thread():
        for step in range(settings.steps):
            input_ids, attention_mask, response_mask = left_padded(batch(rng), pad_id)
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
            target = response_mask[:, 1:]
            loss = -(logp * target).sum() / target.sum()
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * _schedule(step, settings)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    model.eval()
    return float(loss.detach())


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


def _schedule(step: int, settings: WarmStartSettings) -> float:
    warmup = min(1.0, (step + 1) / settings.warmup_steps)
    return warmup * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / settings.steps)))


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


def left_padded(rows: list[tuple], pad_id: int):
    """(input_ids, attention_mask, response_mask) of prompt+response rows, left-padded as verl does.

    A row is ``(prompt_ids, response_ids)``, or ``(prompt_ids, response_ids, response_mask)`` when
    some response tokens are not the model's (a tool's answer: 0)."""
    import torch

    width = max(len(row[0]) + len(row[1]) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), width))
    for index, (prompt, response, *mask) in enumerate(rows):
        start = width - len(prompt) - len(response)
        input_ids[index, start:] = torch.tensor(prompt + response)
        attention_mask[index, start:] = 1
        if response:
            response_mask[index, width - len(response) :] = torch.tensor(mask[0] if mask else [1.0] * len(response))
    return input_ids, attention_mask, response_mask


def position_ids(attention_mask):
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)
