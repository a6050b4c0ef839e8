"""Value pretraining, for any task: verl's critic learns the return of the warm start's own responses
before RL starts.

The CPU analogue of VAPO's value pretraining. A task samples the warm-started policy's responses and
scores them (:mod:`verl_ext.tasks.arith.value_pretraining`, :mod:`verl_ext.tasks.tool.value_pretraining`);
here the critic is what verl builds from the model directory — ``AutoModelForTokenClassification``
with one label, the warm start's body and a fresh linear head ``score`` — trained with verl's own
``compute_value_loss`` towards the Monte-Carlo return G_t = score (γ = 1, the reward on the last
token) at the response's written tokens (mask 1: a tool's answer is not trained, as in verl), in
epochs over the responses, until the held-out explained variance at the task's chosen states stops
improving.

Value positions follow verl's critic: the value of response token t is the head's output at the
position before t (the state s_t: the prompt and the response tokens < t).

Deterministic given the seed (one CPU thread, seeded sampling and initialisation).
"""

from __future__ import annotations

import copy
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from verl_ext.tasks.common import left_padded, position_ids
from verl_ext.torch_threads import one_torch_thread


@dataclass(frozen=True)
class ValuePretrainingSettings:
    lr: float = 3e-4
    batch_size: int = 32
    #: Evaluate after every epoch over the responses; stop when the held-out EV at the task's chosen
    #: states has not beaten its best by ``min_gain`` for ``patience`` epochs (or after
    #: ``max_epochs``), and keep the weights of the best epoch.
    max_epochs: int = 12
    patience: int = 2
    min_gain: float = 0.01
    held_out_samples: int = 8


@dataclass
class ScoredResponses:
    """Sampled responses as prompt+response rows, their scores, and named sets of states to measure
    the critic at."""

    #: (prompt ids, response ids with EOS when generated, response mask: 1 written, 0 a tool's answer)
    rows: list[tuple[list[int], list[int], list[float]]]
    scores: list[float]
    pad_id: int
    #: name -> per response, the response positions t whose states s_t are in the set
    states: dict[str, list[list[int]]]

    def select(self, indices: list[int]) -> "ScoredResponses":
        pick = lambda values: [values[i] for i in indices]  # noqa: E731
        return ScoredResponses(pick(self.rows), pick(self.scores), self.pad_id, {k: pick(v) for k, v in self.states.items()})

    def tensors(self):
        """input_ids, attention_mask, response_mask (B, W) and returns (B, W): the score on every
        written response token (the Monte-Carlo return with γ = 1 and the reward on the last token)."""
        import torch

        input_ids, attention_mask, response_mask = left_padded(self.rows, self.pad_id)
        returns = response_mask * torch.tensor(self.scores)[:, None]
        return input_ids, attention_mask, response_mask, returns


def pretrain_value(policy, train_set: ScoredResponses, held_out: ScoredResponses, settings: ValuePretrainingSettings, seed: int, select_by: str):
    """Build the critic from ``policy`` and train it on ``train_set`` (see the module docstring);
    return (critic, report). ``select_by``: the states (a key of ``held_out.states``) whose held-out
    explained variance picks the epoch kept.

    ``report``: the settings, the number of responses, the held-out fit after each epoch
    (:func:`held_out_fit`), the epoch kept, the number of updates and the seconds taken.
    """
    import torch
    from transformers import AutoModelForTokenClassification

    started = time.monotonic()
    torch.manual_seed(seed)
    critic = value_model(policy, AutoModelForTokenClassification)
    optimizer = torch.optim.Adam(critic.parameters(), lr=settings.lr)
    rng = random.Random(seed)
    history = [held_out_fit(critic, held_out)]
    best_epoch, best_state = 0, copy.deepcopy(critic.state_dict())
    score = lambda fit: -math.inf if fit[f"ev_{select_by}"] is None else fit[f"ev_{select_by}"]  # noqa: E731
    updates = 0
    with one_torch_thread():
        for _ in range(settings.max_epochs):
            order = list(range(len(train_set.rows)))
            rng.shuffle(order)
            critic.train()
            for start in range(0, len(order), settings.batch_size):
                loss = value_loss(critic, train_set.select(order[start : start + settings.batch_size]))
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
                optimizer.step()
                updates += 1
            history.append(held_out_fit(critic, held_out))
            if score(history[-1]) >= score(history[best_epoch]) + settings.min_gain:
                best_epoch, best_state = len(history) - 1, copy.deepcopy(critic.state_dict())
            elif len(history) - 1 - best_epoch >= settings.patience:
                break
    critic.load_state_dict(best_state)
    critic.eval()
    report = {
        "settings": asdict(settings),
        "responses": len(train_set.rows),
        "held_out_responses": len(held_out.rows),
        "selected_by": f"ev_{select_by}",
        "held_out_fit_per_epoch": history,
        "best_epoch": best_epoch,
        "held_out_fit": history[best_epoch],
        "updates": updates,
        "seconds": round(time.monotonic() - started, 1),
    }
    return critic, report


def save_critic(directory, critic, tokenizer, report: dict) -> None:
    """Write the critic (``critic/``, with the tokenizer) and ``value_pretraining.json`` (``report``)
    under ``directory``; print one line of the report's held-out fit."""
    directory = Path(directory)
    critic.save_pretrained(directory / "critic")
    tokenizer.save_pretrained(directory / "critic")
    (directory / "value_pretraining.json").write_text(json.dumps(report, indent=2))
    fits = ", ".join(
        f"{name[3:].replace('_', ' ')} {'—' if value is None else f'{value:.2f}'}"
        for name, value in report["held_out_fit"].items() if name.startswith("ev_")
    )  # fmt: skip
    print(
        f"[verl-ext] critic pretrained in {report['seconds']:.0f} s ({report['updates']} updates); held-out explained variance: {fits}",
        file=sys.stderr, flush=True,
    )  # fmt: skip


def value_model(policy, auto_class):
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


def values(critic, input_ids, attention_mask, response_mask):
    """V(s_t) on response positions (B, W): the head's output one position before each token."""
    import torch

    head = critic(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)).logits[..., 0]
    out = torch.zeros_like(head)
    out[:, 1:] = head[:, :-1]
    return out * response_mask


def value_loss(critic, batch: ScoredResponses):
    """verl's ``compute_value_loss`` of V(s_t) against G_t over the batch's written response tokens."""
    from verl.trainer.ppo.core_algos import compute_value_loss

    input_ids, attention_mask, response_mask, returns = batch.tensors()
    vpreds = values(critic, input_ids, attention_mask, response_mask)
    # old values = the prediction itself: verl's value clipping is then inactive, as at a first update
    loss, *_ = compute_value_loss(vpreds, returns, vpreds.detach(), response_mask, cliprange_value=0.5)
    return loss


def held_out_fit(critic, responses: ScoredResponses) -> dict:
    """``ev_<name>``: the explained variance 1 − Var(G − V)/Var(G) of V(s_t) against G over the
    states of each named set (None without states, or when G does not vary there), rounded to 4
    digits; ``mean_abs_error``: mean |V − G| over every written response token."""
    import torch

    predicted, response_mask, returns = predicted_values(critic, responses)
    width = response_mask.shape[1]
    fit = {}
    for name, per_response in responses.states.items():
        chosen = torch.zeros_like(response_mask, dtype=torch.bool)
        for row, ((_, response, _), positions) in enumerate(zip(responses.rows, per_response)):
            chosen[row, [width - len(response) + t for t in positions]] = True
        fit[f"ev_{name}"] = _explained_variance(predicted[chosen], returns[chosen])
    valid = response_mask.bool()
    fit["mean_abs_error"] = round(float((predicted[valid] - returns[valid]).abs().mean()), 4)
    return fit


def predicted_values(critic, responses: ScoredResponses):
    """(V(s_t), response_mask, returns), each (B, W), of ``responses`` under ``critic`` in eval mode."""
    import torch

    input_ids, attention_mask, response_mask, returns = responses.tensors()
    with torch.no_grad(), one_torch_thread():
        critic.eval()
        return values(critic, input_ids, attention_mask, response_mask), response_mask, returns


def _explained_variance(values, returns) -> float | None:
    from verl_ext.step_metrics import explained_variance

    ev = explained_variance(values.double().numpy(), returns.double().numpy())
    return None if ev is None else round(ev, 4)
