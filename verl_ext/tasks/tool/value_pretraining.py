"""The tool task's value pretraining: the warm start's own multi-turn rollouts, with their tool holes,
scored, and where the critic is measured (:mod:`verl_ext.tasks.value_pretraining` trains it).

A rollout follows verl's ``ToolAgentLoop`` with the task's settings (``max_assistant_turns=2``,
hermes calls, ``max_tool_response_length=16`` cut on the right, ``max_parallel_calls=1``) and verl's
response and model lengths:

1. the first assistant turn is sampled (temperature 1) until EOS, within the room the model length
   leaves (min(response length, prompt length + response length − context));
2. verl's hermes parser finds the calls in its decoded text (``<tool_call>{json}</tool_call>``);
   without one, or once the response length is reached, the rollout ends;
3. the first call runs: ``add(a, b)`` gives the sum; an unknown name, arguments that are not JSON or
   a failing call give verl's error texts; the tool's message (mask 0) is the chat template's
   render of it and the next assistant header (:func:`verl_ext.tasks.tool.warm_start.tool_message_ids`),
   unless it would reach the response length (then the rollout ends without it);
4. the second assistant turn is sampled in the room left, and the rollout ends (the turn limit);
5. the response is cut at the response length and scored as verl's reward scores it (the decoded
   text after the last tool response, :func:`verl_ext.tasks.tool.task.score_solution`).

The tool's call reward is left out, as verl leaves it out of the token rewards by default.

The critic is measured at five sets of states (docs/tasks.md, the tool task's critic):
``first_token`` (s_0, which decides between ``<tool_call>`` and answering at once),
``after_decision`` (s_1, which has seen that decision), ``after_tool`` (the first token written
after the tool's answer: the state after the hole), ``after_verdict`` (the states that have seen the
verdict) and ``written`` (every written token). The epoch kept is the one with the best held-out
explained variance after the verdict, as on the arithmetic task.

How far any critic can go after the tool's answer (:func:`ev_ceiling_after_tool`): the outcome is
then still the second turn's sample, so the best value E[G | s] explains Var(E[G | s]) / Var(G) of
it, estimated from several second turns per state.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from verl_ext.tasks.arith.task import VERDICT_MARK, Problem, verdict_index
from verl_ext.tasks.arith.warm_start import prompt_ids
from verl_ext.tasks.common import left_padded
from verl_ext.tasks.tool.calculator import add
from verl_ext.tasks.tool.task import CALL_END, CALL_START, TOOL_NAME, score_solution
from verl_ext.tasks.tool.warm_start import tool_message_ids
from verl_ext.tasks.value_pretraining import ScoredResponses, ValuePretrainingSettings
from verl_ext.torch_threads import one_torch_thread

STATES = ("first_token", "after_decision", "after_tool", "after_verdict", "written")
#: verl's hermes parser's pattern.
_CALL = re.compile(re.escape(CALL_START) + "(.*?)" + re.escape(CALL_END), re.DOTALL)


@dataclass(frozen=True)
class RolloutLimits:
    """The run's lengths (:class:`verl_ext.tasks.tool.assets.ToolAssets`) and the agent loop's settings."""

    prompt_length: int
    response_length: int
    max_tool_response_length: int = 16


def pretrain_value(policy, tokenizer, train: list[Problem], val: list[Problem], settings: ValuePretrainingSettings, seed: int, limits: RolloutLimits):
    """Roll out and score the warm start (one rollout per training row, ``held_out_samples`` per
    validation prompt), then train the critic on them; return (critic, report): the report of
    :func:`verl_ext.tasks.value_pretraining.pretrain_value` with the rollouts' ``calls`` (share that
    start a call, share whose call the tool answered) and ``mean_score``, on the training rollouts."""
    from verl_ext.tasks import value_pretraining

    train_set, calls = rollouts(policy, tokenizer, train, samples=1, seed=seed, limits=limits)
    held_out, _ = rollouts(policy, tokenizer, val, samples=settings.held_out_samples, seed=seed + 1, limits=limits)
    critic, report = value_pretraining.pretrain_value(policy, train_set, held_out, settings, seed, select_by="after_verdict")
    mean_score = round(sum(train_set.scores) / len(train_set.scores), 4)
    ceiling = ev_ceiling_after_tool(policy, tokenizer, held_out, val, settings.held_out_samples, seed + 2, limits)
    by_path = value_after_decision(critic, held_out, tokenizer.convert_tokens_to_ids(CALL_START))
    return critic, {**report, "calls": calls, "mean_score": mean_score, "ev_ceiling_after_tool": ceiling, "after_decision": by_path}


def value_after_decision(critic, responses: ScoredResponses, call_token: int) -> dict:
    """What the critic makes of the call decision, on held-out rollouts: for the responses that start
    a call (``call``) and those that answer at once (``answer``), their number, mean return G and mean
    V(s_1), the value of the state that has seen the decision."""
    from verl_ext.tasks.value_pretraining import predicted_values

    predicted, response_mask, returns = predicted_values(critic, responses)
    width = response_mask.shape[1]
    paths = {"call": [], "answer": []}
    for row, (_, response, _) in enumerate(responses.rows):
        if len(response) > 1:
            at = width - len(response) + 1
            paths["call" if response[0] == call_token else "answer"].append((float(predicted[row, at]), float(returns[row, at])))
    return {
        path: {"responses": len(pairs), "mean_return": round(sum(g for _, g in pairs) / len(pairs), 4),
               "mean_value": round(sum(v for v, _ in pairs) / len(pairs), 4)} if pairs else {"responses": 0}
        for path, pairs in paths.items()
    }  # fmt: skip


def ev_ceiling_after_tool(policy, tokenizer, held_out: ScoredResponses, val: list[Problem], samples: int, seed: int, limits: RolloutLimits, continuations: int = 16) -> float | None:
    """The most explained variance any critic reaches at the held-out states after the tool's answer:
    1 − mean_s Var(G | s) / Var(G), with ``continuations`` second turns sampled from each such state
    (``held_out``: ``samples`` rollouts per problem of ``val``, in order); None without such states."""
    import numpy as np

    model_length = limits.prompt_length + limits.response_length
    contexts, answers = [], []
    for i, ((prompt, response, _), after_tool) in enumerate(zip(held_out.rows, held_out.states["after_tool"])):
        if after_tool:
            contexts.append((prompt, response[: after_tool[0]]))
            answers.append(val[i // samples].answer())
    if len(contexts) < 2:
        return None
    repeated = [c for c in contexts for _ in range(continuations)]
    rooms = [min(limits.response_length - len(r), model_length - len(p) - len(r)) for p, r in repeated]
    turns = _sample_turns(policy, tokenizer, [p + r for p, r in repeated], rooms, seed)
    returns = np.array([
        score_solution(tokenizer.decode(r + turn, skip_special_tokens=True), answer).score
        for (p, r), turn, answer in zip(repeated, turns, (a for a in answers for _ in range(continuations)))
    ]).reshape(len(contexts), continuations)  # fmt: skip
    ceiling = ev_ceiling(returns)
    return None if ceiling is None else round(ceiling, 4)


def ev_ceiling(returns) -> float | None:
    """1 − mean_s Var(G | s) / Var(G) from ``returns`` (S, K): K returns sampled from each of S states,
    variances with n − 1; None when G does not vary."""
    import numpy as np

    returns = np.asarray(returns, dtype=np.float64)
    total = returns.var(ddof=1)
    return None if total == 0 else float(1 - returns.var(axis=1, ddof=1).mean() / total)


def tool_text(call_json: str, max_length: int) -> str:
    """What verl's tool agent loop answers to one parsed call: the calculator's sum, or verl's error
    text; cut on the right at ``max_length`` characters as verl cuts it."""
    try:
        call = json.loads(call_json)
        name, arguments = call["name"], call["arguments"]
    except Exception:  # verl's parser skips a call it cannot decode
        return ""
    if name != TOOL_NAME:
        text = f"Unknown function '{name}'. Available tools: ['{TOOL_NAME}']"
    else:
        try:
            text, _reward = add(**arguments)
        except Exception as error:
            text = f"Error executing tool '{TOOL_NAME}': {error}"
    return text[:max_length] + "...(truncated)" if len(text) > max_length else text


def parsed_calls(tokenizer, turn: list[int]) -> list[str]:
    """The JSON of each call verl's hermes parser decodes in a turn (it decodes with special tokens)."""
    text = tokenizer.decode(turn)
    if CALL_START not in text or CALL_END not in text:
        return []
    calls = []
    for match in _CALL.findall(text):
        try:
            call = json.loads(match)
            call["name"], call["arguments"]
        except Exception:
            continue
        calls.append(match)
    return calls


def rollouts(policy, tokenizer, problems: list[Problem], samples: int, seed: int, limits: RolloutLimits) -> tuple[ScoredResponses, dict]:
    """``samples`` rollouts per problem (see the module docstring), scored, with the states of
    :data:`STATES`; and ``{"start_a_call": share, "tool_answered": share}``."""
    prompts = [prompt_ids(tokenizer, p) for p in problems for _ in range(samples)]
    expected = [p.answer() for p in problems for _ in range(samples)]
    model_length = limits.prompt_length + limits.response_length
    room = lambda context: min(limits.response_length, model_length - len(context))  # noqa: E731
    first = _sample_turns(policy, tokenizer, prompts, [room(p) for p in prompts], seed)
    messages: list[list[int] | None] = []
    for turn in first:
        calls = parsed_calls(tokenizer, turn) if len(turn) < limits.response_length else []
        message = tool_message_ids(tokenizer, tool_text(calls[0], limits.max_tool_response_length)) if calls else None
        messages.append(message if message is not None and len(turn) + len(message) < limits.response_length else None)
    answered = [i for i, message in enumerate(messages) if message is not None]
    contexts = [prompts[i] + first[i] + messages[i] for i in answered]
    second = dict(zip(answered, _sample_turns(policy, tokenizer, contexts, [room(c) for c in contexts], seed + 1)))

    call_token = tokenizer.convert_tokens_to_ids(CALL_START)
    mark = tokenizer.convert_tokens_to_ids(VERDICT_MARK)
    rows, scores, states = [], [], {name: [] for name in STATES}
    for i, (prompt, turn, message) in enumerate(zip(prompts, first, messages)):
        response, mask = list(turn), [1.0] * len(turn)
        if message is not None:
            response += message + second[i]
            mask += [0.0] * len(message) + [1.0] * len(second[i])
        response, mask = response[: limits.response_length], mask[: limits.response_length]
        rows.append((prompt, response, mask))
        scores.append(score_solution(tokenizer.decode(response, skip_special_tokens=True), expected[i]).score)
        after_tool = len(turn) + len(message) if message is not None else None
        verdict = verdict_index(response, mark, tokenizer.eos_token_id)
        states["first_token"].append([0])
        states["after_decision"].append([1] if len(response) > 1 else [])
        states["after_tool"].append([after_tool] if after_tool is not None and after_tool < len(response) else [])
        states["after_verdict"].append([] if verdict is None else [t for t in range(verdict + 1, len(response)) if mask[t]])
        states["written"].append([t for t in range(len(response)) if mask[t]])
    calls = {
        "start_a_call": round(sum(turn[:1] == [call_token] for turn in first) / len(first), 4),
        "tool_answered": round(len(answered) / len(first), 4),
    }
    return ScoredResponses(rows, scores, tokenizer.pad_token_id, states), calls


def _sample_turns(policy, tokenizer, contexts: list[list[int]], rooms: list[int], seed: int) -> list[list[int]]:
    """One assistant turn after each context: sampled at temperature 1 until EOS (kept) or its room."""
    import torch

    if not contexts:
        return []
    input_ids, attention_mask, _ = left_padded([(c, []) for c in contexts], tokenizer.pad_token_id)
    torch.manual_seed(seed)
    with torch.no_grad(), one_torch_thread():
        output = policy.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max(rooms), do_sample=True,
            temperature=1.0, top_k=0, top_p=None, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    turns = []
    for generated, room in zip(output[:, input_ids.shape[1] :].tolist(), rooms):
        generated = generated[:room]
        if tokenizer.eos_token_id in generated:
            generated = generated[: generated.index(tokenizer.eos_token_id) + 1]
        turns.append(generated or [tokenizer.eos_token_id])
    return turns
