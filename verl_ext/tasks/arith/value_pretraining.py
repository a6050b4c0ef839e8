"""Value pretraining: the critic learns the outcome of the warm start's own answers before RL starts.

The CPU analogue of VAPO's value pretraining. The warm-started policy answers every training row
once (temperature 1); each response is scored (:func:`verl_ext.tasks.arith.task.score_response`) and its
Monte-Carlo return is the score at every token (γ = 1, the reward sits on the last token). The
critic is what verl builds from the model directory — ``AutoModelForTokenClassification`` with one
label, the warm start's body and a fresh linear head ``score`` — trained with verl's own
``compute_value_loss`` on those returns, in epochs over the responses, until the explained variance
after the verdict on held-out responses (the validation prompts, 8 samples each) stops improving.

Why it is needed: after the verdict the outcome is decided, but to see it the critic must build a
feature the warm start does not have ("does the verdict match whether c = a+b?"). Inside RL it
never does: the actor soon makes wrong verdicts rare, and without them there is nothing to learn
from (issue 15's investigation). Here about a third of the verdicts are wrong (36% with the
default assets), and a few hundred updates at lr 3e-4 learn it.

Value positions follow verl's critic: the value of response token t is the head's output at the
position before t (the state s_t: prompt and response tokens < t).

Deterministic given the seed (one CPU thread, seeded sampling and initialisation).
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import asdict, dataclass

from verl_ext.tasks.arith.task import VERDICT_MARK, Problem, score_response, verdict_index
from verl_ext.tasks.arith.warm_start import prompt_ids
from verl_ext.tasks.common import left_padded, position_ids
from verl_ext.torch_threads import one_torch_thread


@dataclass(frozen=True)
class ValuePretrainingSettings:
    lr: float = 3e-4
    batch_size: int = 32
    #: Evaluate after every epoch over the responses; stop when held-out EV after the verdict has
    #: not beaten its best by ``min_gain`` for ``patience`` epochs (or after ``max_epochs``), and
    #: keep the weights of the best epoch.
    max_epochs: int = 12
    patience: int = 2
    min_gain: float = 0.01
    held_out_samples: int = 8


@dataclass(frozen=True)
class CriticFit:
    """Held-out explained variance of V(s_t) against the return, after and before the verdict."""

    ev_after_verdict: float | None
    ev_before_verdict: float | None
    mean_abs_error: float


def pretrain_value(policy, tokenizer, train: list[Problem], val: list[Problem], settings: ValuePretrainingSettings, seed: int):
    """Build the critic from ``policy`` and train it (see the module docstring); return (critic, report).

    ``report``: the settings, responses and share of wrong verdicts, the held-out fit after each
    epoch, the number of updates and the seconds taken.
    """
    import torch
    from transformers import AutoModelForTokenClassification

    started = time.monotonic()
    train_set = _scored_responses(policy, tokenizer, train, samples=1, seed=seed)
    held_out = _scored_responses(policy, tokenizer, val, samples=settings.held_out_samples, seed=seed + 1)
    torch.manual_seed(seed)
    critic = _value_model(policy, AutoModelForTokenClassification)
    optimizer = torch.optim.Adam(critic.parameters(), lr=settings.lr)
    rng = random.Random(seed)
    history = [asdict(_fit(critic, held_out))]
    best_epoch, best_state = 0, copy.deepcopy(critic.state_dict())
    updates = 0
    with one_torch_thread():
        for _ in range(settings.max_epochs):
            order = list(range(len(train_set.rows)))
            rng.shuffle(order)
            critic.train()
            for start in range(0, len(order), settings.batch_size):
                batch = train_set.select(order[start : start + settings.batch_size])
                loss = _value_loss(critic, batch)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
                optimizer.step()
                updates += 1
            history.append(asdict(_fit(critic, held_out)))
            if _score(history[-1]) >= _score(history[best_epoch]) + settings.min_gain:
                best_epoch, best_state = len(history) - 1, copy.deepcopy(critic.state_dict())
            elif len(history) - 1 - best_epoch >= settings.patience:
                break
    critic.load_state_dict(best_state)
    critic.eval()
    report = {
        "settings": asdict(settings),
        "responses": len(train_set.rows),
        "wrong_verdicts": train_set.wrong_verdict_share(),
        "held_out_responses": len(held_out.rows),
        "held_out_fit_per_epoch": history,
        "best_epoch": best_epoch,
        "held_out_fit": history[best_epoch],
        "updates": updates,
        "seconds": round(time.monotonic() - started, 1),
    }
    return critic, report


# --------------------------------------------------------------------------- data


@dataclass
class _Responses:
    """Sampled responses, their scores and verdict positions, as padded prompt+response rows."""

    rows: list[tuple[list[int], list[int]]]  # (prompt ids, response ids with EOS when generated)
    scores: list[float]
    verdicts: list[int | None]  # index of the verdict token in the response
    verdict_right: list[bool]
    pad_id: int

    def select(self, indices: list[int]) -> "_Responses":
        pick = lambda values: [values[i] for i in indices]  # noqa: E731
        return _Responses(pick(self.rows), pick(self.scores), pick(self.verdicts), pick(self.verdict_right), self.pad_id)

    def wrong_verdict_share(self) -> float:
        judged = [right for right, verdict in zip(self.verdict_right, self.verdicts) if verdict is not None]
        return round(1 - sum(judged) / max(len(judged), 1), 3)

    def tensors(self):
        """input_ids, attention_mask, response_mask (B, W) and returns (B, W): the score on every
        response token (the Monte-Carlo return with γ = 1 and the reward on the last token)."""
        import torch

        input_ids, attention_mask, response_mask = left_padded(self.rows, self.pad_id)
        returns = response_mask * torch.tensor(self.scores)[:, None]
        return input_ids, attention_mask, response_mask, returns


def _scored_responses(policy, tokenizer, problems: list[Problem], samples: int, seed: int) -> _Responses:
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
    rows, scores, verdicts, verdict_right = [], [], [], []
    mark = tokenizer.convert_tokens_to_ids(VERDICT_MARK)
    for prompt, generated, answer in zip(prompts, output[:, input_ids.shape[1] :].tolist(), expected):
        response = generated[: generated.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in generated else generated
        response = [t for t in response if t != tokenizer.pad_token_id] or [tokenizer.eos_token_id]
        score = score_response(tokenizer.decode(response, skip_special_tokens=True), answer)
        rows.append((prompt, response))
        scores.append(score.score)
        verdicts.append(verdict_index(response, mark, tokenizer.eos_token_id))
        verdict_right.append(score.verdict_right)
    return _Responses(rows, scores, verdicts, verdict_right, tokenizer.pad_token_id)


# --------------------------------------------------------------------------- model and loss


def _value_model(policy, auto_class):
    """verl's critic for ``policy``'s weights: token classification, one label, fresh head."""
    import tempfile

    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its load report lists the fresh head as "missing": expected here
    try:
        with tempfile.TemporaryDirectory() as directory:
            policy.save_pretrained(directory)
            return auto_class.from_pretrained(directory, num_labels=1)
    finally:
        logging.set_verbosity(verbosity)


def _values(critic, input_ids, attention_mask, response_mask):
    """V(s_t) on response positions (B, W): the head's output one position before each token."""
    import torch

    head = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)).logits[..., 0]
    values = torch.zeros_like(head)
    values[:, 1:] = head[:, :-1]
    return values * response_mask


def _value_loss(critic, batch: _Responses):
    from verl.trainer.ppo.core_algos import compute_value_loss

    input_ids, attention_mask, response_mask, returns = batch.tensors()
    vpreds = _values(critic, input_ids, attention_mask, response_mask)
    # old values = the prediction itself: verl's value clipping is then inactive, as at a first update
    loss, *_ = compute_value_loss(vpreds, returns, vpreds.detach(), response_mask, cliprange_value=0.5)
    return loss


def _fit(critic, responses: _Responses) -> CriticFit:
    import torch

    input_ids, attention_mask, response_mask, returns = responses.tensors()
    with torch.no_grad(), one_torch_thread():
        critic.eval()
        values = _values(critic, input_ids, attention_mask, response_mask)
    width = input_ids.shape[1]
    after, before = torch.zeros_like(response_mask, dtype=torch.bool), torch.zeros_like(response_mask, dtype=torch.bool)
    for row, ((_, response), verdict) in enumerate(zip(responses.rows, responses.verdicts)):
        if verdict is None:
            continue
        start = width - len(response)
        before[row, start : start + verdict + 1] = True  # up to the state that chooses the verdict
        after[row, start + verdict + 1 :] = True  # states that have seen the verdict
    valid = response_mask.bool()
    return CriticFit(
        ev_after_verdict=_explained_variance(values[after], returns[after]),
        ev_before_verdict=_explained_variance(values[before], returns[before]),
        mean_abs_error=round(float((values[valid] - returns[valid]).abs().mean()), 4),
    )


def _explained_variance(values, returns) -> float | None:
    from verl_ext.step_metrics import explained_variance

    ev = explained_variance(values.double().numpy(), returns.double().numpy())
    return None if ev is None else round(ev, 4)


def _score(fit: dict) -> float:
    """The held-out EV after the verdict; −∞ when undefined (no verdicts, or no spread in G)."""
    return -math.inf if fit["ev_after_verdict"] is None else fit["ev_after_verdict"]
