"""The tool task's warm start: a short supervised fine-tune that teaches the format of both paths,
with two weak, documented priors, so that RL has two decisions to learn.

* ``tool_prior``: each training example takes the tool path (call, the tool's answer, the answer)
  with this probability, else answers at once. The decision is the response's first token,
  ``<tool_call>`` or ``等``.
* ``verdict_prior``: as in the arithmetic task, the verdict is right with this probability.

Examples are built from the same pieces as verl's tool agent loop builds a rollout (the chat
template's prompt, the written call and EOS, the agent loop's tool message, the answer and EOS;
tests/tasks/test_tool_task.py compares them with verl's own token builder); the tool message's
tokens carry no loss, as their mask is 0 in RL.

The evaluation needs no multi-turn sampler: the probability of calling the tool (the first token,
exactly), and the greedy answer with each path forced, which measures how far the model's head
falls short of the tool: the reason RL should learn to call it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from verl_ext.tasks.arith import warm_start as arith_warm_start
from verl_ext.tasks.arith.task import Problem, score_response
from verl_ext.tasks.arith.warm_start import answer_ids, prompt_ids
from verl_ext.tasks.common import fine_tune, left_padded, position_ids
from verl_ext.tasks.tool.task import call_text
from verl_ext.torch_threads import one_torch_thread


@dataclass(frozen=True)
class WarmStartSettings(arith_warm_start.WarmStartSettings):
    """The arithmetic task's settings, with the tool task's defaults and the prior on calling."""

    steps: int = 300
    verdict_prior: float = 1.0
    tool_prior: float = 0.3


@dataclass(frozen=True)
class Evaluation:
    """On held-out prompts: the mean probability of calling the tool first, and the greedy answer's
    shares (fully right, right sum, right verdict) with the tool path and with the head path forced."""

    call_probability: float
    tool_acc: float
    tool_sum: float
    tool_verdict: float
    head_acc: float
    head_sum: float
    head_verdict: float
    prompts: int


def call_ids(tokenizer, p: Problem) -> list[int]:
    """The written call turn: the call and EOS."""
    return tokenizer.encode(call_text(p), add_special_tokens=False) + [tokenizer.eos_token_id]


def tool_message_ids(tokenizer, content: str) -> list[int]:
    """What the agent loop appends after a call (mask 0): the tool's message ``content`` as the
    chat template renders it, and the next assistant header."""
    text = tokenizer.apply_chat_template([{"role": "tool", "content": content}], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def example(tokenizer, p: Problem, use_tool: bool, right_verdict: bool) -> tuple[list[int], list[int], list[float]]:
    """(prompt ids, response ids, response mask) of one response, either path."""
    answer = answer_ids(tokenizer, p, right_verdict)
    if not use_tool:
        return prompt_ids(tokenizer, p), answer, [1.0] * len(answer)
    call, message = call_ids(tokenizer, p), tool_message_ids(tokenizer, str(p.a + p.b))
    return prompt_ids(tokenizer, p), call + message + answer, [1.0] * len(call) + [0.0] * len(message) + [1.0] * len(answer)


def supervised_fine_tune(model, tokenizer, problems: list[Problem], settings: WarmStartSettings, seed: int) -> float:
    """Fine-tune ``model`` in place on ``problems``; return the last loss (mean NLL of the written tokens)."""

    def batch(rng: random.Random):
        chosen = [rng.choice(problems) for _ in range(settings.batch_size)]
        return [
            example(tokenizer, p, rng.random() < settings.tool_prior, rng.random() < settings.verdict_prior)
            for p in chosen
        ]

    return fine_tune(model, tokenizer.pad_token_id, batch, settings, seed)


def evaluate(model, tokenizer, problems: list[Problem], max_new_tokens: int = 12) -> Evaluation:
    """The call probability, and greedy answers with either path forced (see :class:`Evaluation`)."""
    import torch

    call_token = tokenizer.convert_tokens_to_ids("<tool_call>")
    head_start = tokenizer.encode("等", add_special_tokens=False)
    prompts = [prompt_ids(tokenizer, p) for p in problems]
    input_ids, attention_mask, _ = left_padded([(p, []) for p in prompts], tokenizer.pad_token_id)
    with torch.no_grad(), one_torch_thread():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)).logits
        call_probability = torch.softmax(logits[:, -1].double(), -1)[:, call_token].mean().item()
    tool_prefixes = [call_ids(tokenizer, p) + tool_message_ids(tokenizer, str(p.a + p.b)) for p in problems]
    tool = _scores(model, tokenizer, problems, prompts, tool_prefixes, max_new_tokens)
    head = _scores(model, tokenizer, problems, prompts, [head_start] * len(problems), max_new_tokens, head_start)
    n = len(problems)
    return Evaluation(
        call_probability=round(call_probability, 4),
        tool_acc=sum(s.acc for s in tool) / n, tool_sum=sum(s.sum_right for s in tool) / n,
        tool_verdict=sum(s.verdict_right for s in tool) / n,
        head_acc=sum(s.acc for s in head) / n, head_sum=sum(s.sum_right for s in head) / n,
        head_verdict=sum(s.verdict_right for s in head) / n,
        prompts=n,
    )  # fmt: skip


def _scores(model, tokenizer, problems, prompts, prefixes, max_new_tokens, kept: list[int] = ()):
    """Greedy answers after ``prompt + prefix`` for each problem, scored; ``kept``: the part of the
    prefix that belongs to the answer (the head path's forced first character)."""
    import torch

    input_ids, attention_mask, _ = left_padded([(p + q, []) for p, q in zip(prompts, prefixes)], tokenizer.pad_token_id)
    with torch.no_grad(), one_torch_thread():
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    texts = tokenizer.batch_decode([list(kept) + row for row in output[:, input_ids.shape[1] :].tolist()], skip_special_tokens=True)
    return [score_response(text, p.answer()) for text, p in zip(texts, problems)]
