"""Synthetic traces for the inspection tests, with expected values that do not come from the code
under test: direct sums written from docs/definitions.md §5 on each row's compacted valid tokens, or
verl's own functions. Traces are written with the real TraceWriter (the format is its contract).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow.parquet as pq
import torch

from tests.support.reference import gae_row, mc_row, nstep_row, td0_row, turn_gae_row
from verl_ext import registry
from verl_ext.options import TraceOptions
from verl_ext.trace.capture import StepCapture
from verl_ext.trace.schema import STEP_RECORD_METADATA_KEY, RunRecord, token_file
from verl_ext.trace.writer import TraceWriter

# ---------------------------------------------------------------- definitions (direct sums: tests/support/reference.py)


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's own masked_whiten."""
    from verl.utils.torch_functional import masked_whiten

    return masked_whiten(x, mask)


# ---------------------------------------------------------------- a tokenizer

SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>"]
#: Every character is one token; ids 4 … 21 are ASCII (random_batch draws ids 7 … 19).
CHARACTERS = "0123456789+-=?.,*/ " + "请问是的，等于！？"
EOS = SPECIAL_TOKENS.index("</s>")


def token_ids(text: str) -> list[int]:
    return [len(SPECIAL_TOKENS) + CHARACTERS.index(ch) for ch in text]


def save_char_tokenizer(path: Path) -> str:
    """A character-level Hugging Face tokenizer, saved as a tokenizer directory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    tokenizer.save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------- batches


@dataclass
class Batch:
    """One step's tensors, (B, T), as verl holds them after compute_advantage."""

    mask: torch.Tensor
    responses: torch.Tensor
    prompts: torch.Tensor
    prompt_mask: torch.Tensor
    scores: torch.Tensor
    kl: torch.Tensor | None
    rewards: torch.Tensor
    values: torch.Tensor | None
    returns: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    advantage_raw: torch.Tensor | None = None
    kl_coef: float | None = None
    turn_score: torch.Tensor | None = None
    tool_reward: torch.Tensor | None = None
    #: verl's rollout correction (docs/definitions.md#off-policy-tokens): the log-probs, its weights and
    #: the tokens its rejection took out of ``mask``
    old_log_prob: torch.Tensor | None = None
    rollout_log_prob: torch.Tensor | None = None
    rollout_is_weight: torch.Tensor | None = None
    rejected: torch.Tensor | None = None
    #: the numbers verl logged of the step's correction (rollout_corr/…)
    logged: dict | None = None


def random_batch(
    seed: int,
    B: int = 6,
    T: int = 24,
    kl_coef: float | None = None,
    interior: bool = True,
    dense_scores: bool = False,
    holes: int = 1,
    turn_rewards: bool = False,
) -> Batch:
    """Responses of random lengths (trailing padding), a few interior masked tokens (tool output:
    ``holes`` spans of two in every other response, so up to ``holes`` + 1 assistant turns),
    an outcome score on the last valid token (or, ``dense_scores``, a process score on every valid
    token), KL-shaped small per-token terms, bf16-quantised values. Masked positions hold junk
    (large numbers), as verl may leave there."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 3, T + 1, (B,), generator=g)
    lengths[0] = T  # one full-length row
    positions = torch.arange(T)
    mask = (positions < lengths[:, None]).float()
    if interior:
        for b in range(1, B, 2):  # observation spans inside every other response
            for _ in range(holes):
                start = int(torch.randint(1, max(2, int(lengths[b]) - 3), (1,), generator=g))
                mask[b, start : start + 2] = 0
        mask[:, 0] = 1  # keep the first token valid
    last = (mask * (positions + 1)).argmax(dim=1)
    scores = torch.zeros(B, T)
    scores[torch.arange(B), last] = torch.randint(0, 2, (B,), generator=g).float() + 0.25
    if dense_scores:
        scores = (torch.rand(B, T, generator=g) + 0.2) * torch.sign(torch.rand(B, T, generator=g) - 0.3) * mask
    junk = 100.0 * (1 - mask)
    values = (torch.rand(B, T, generator=g) * 2 - 0.5).to(torch.bfloat16).float() * mask + junk
    kl = None
    rewards = scores.clone()
    if kl_coef is not None:
        kl = torch.rand(B, T, generator=g).mul(0.2).sub(0.05) * mask  # kld * response_mask, as verl
        rewards = scores - kl_coef * kl
    turn_score = tool_reward = None
    if turn_rewards:
        turn_score, tool_reward = torch.zeros(B, T), torch.zeros(B, T)
        for b in range(B):
            for t in range(T - 1):
                if mask[b, t] and not mask[b, t + 1] and mask[b, t + 1 :].any():
                    tool_reward[b, t] = 0.1
            turn_score[b, int(last[b])] = 0.3
        rewards = rewards + turn_score + tool_reward
    responses = torch.randint(7, 20, (B, T), generator=g)
    prompts = torch.randint(7, 20, (B, 5), generator=g)
    prompt_mask = torch.ones(B, 5, dtype=torch.bool)
    prompt_mask[:, :2] = torch.rand(B, 2, generator=g) > 0.5  # left padding
    return Batch(mask, responses, prompts, prompt_mask, scores, kl, rewards, values, kl_coef=kl_coef, turn_score=turn_score, tool_reward=tool_reward)


def by_definition(
    batch: Batch,
    name: str,
    gamma: float,
    lam: float = 1.0,
    n: int | None = None,
    lam_actor: float | None = None,
    alpha: float | None = None,
    whitened: bool = True,
    lam_critic: float | None = None,
) -> Batch:
    """Returns, raw advantages and advantages from the direct sums, row by row on valid tokens
    (``turn_gae``: returns GAE(λ_critic, default λ) per token, raw advantage A_k of each turn)."""
    B, T = batch.mask.shape
    returns = torch.full((B, T), 55.0)  # junk at masked positions
    raw = torch.full((B, T), -55.0)
    for b in range(B):
        idx = torch.nonzero(batch.mask[b]).flatten().tolist()
        r = [float(batch.rewards[b, i]) for i in idx]
        v = [float(batch.values[b, i]) for i in idx]
        if name == "mc":
            g = mc_row(r, gamma)
        elif name == "td0":
            g = td0_row(r, v, gamma)
        elif name == "nstep":
            g = nstep_row(r, v, gamma, n)
        elif name == "turn_gae":
            g = [a + vi for a, vi in zip(gae_row(r, v, gamma, lam if lam_critic is None else lam_critic), v)]
        else:
            g = [a + vi for a, vi in zip(gae_row(r, v, gamma, lam), v)]
        a = [gi - vi for gi, vi in zip(g, v)]
        if name == "gae_ext" and (lam_actor is not None or alpha is not None):
            actor_lam = lam_actor if alpha is None else min(1.0, max(0.0, 1 - 1 / (alpha * len(idx))))
            a = gae_row(r, v, gamma, actor_lam)
        if name == "turn_gae":
            a = turn_gae_row(batch.rewards[b].tolist(), batch.values[b].tolist(), batch.mask[b].tolist(), gamma, lam)[idx]
        returns[b, idx] = torch.tensor(g, dtype=torch.float64).float()
        raw[b, idx] = torch.tensor(a, dtype=torch.float64).float()
    advantages = whiten(raw, batch.mask) if whitened else raw.clone()
    return replace(batch, returns=returns, advantage_raw=raw, advantages=advantages)


def by_verl_gae(batch: Batch, gamma: float, lam: float) -> Batch:
    """verl's compute_gae_advantage_return; raw advantage rebuilt as returns − values, as traced."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    advantages, returns = compute_gae_advantage_return(batch.rewards, batch.values, batch.mask, gamma, lam)
    return replace(batch, returns=returns, advantages=advantages, advantage_raw=returns - batch.values)


# ---------------------------------------------------------------- traces


def algorithm(name: str, gamma: float = 1.0, lam: float = 1.0, kl: str | None = None, **extra) -> dict:
    record = {
        "adv_estimator": name,
        "gamma": gamma,
        "lam": lam,
        "n_step": None,
        "lam_critic": None,
        "lam_actor": None,
        "lam_length_alpha": None,
        "whiten_advantages": True if name in ("mc", "td0", "nstep", "gae_ext", "turn_gae", "gae") else None,
        "norm_adv_by_std_in_grpo": True,
        "use_kl_in_reward": kl is not None,
        "kl_penalty": kl or "kl",
        "kl_ctrl": {"type": "fixed", "kl_coef": 0.001},
    }
    record.update(extra)
    return record


def write_trace(
    directory: Path,
    algo: dict,
    batches: dict[int, Batch],
    max_samples: int | None = None,
    tokenizer_path: str = "",
    updates: dict[int, list] | None = None,
    update_settings: dict | None = None,
    truncations: dict | None = None,
    ends: tuple[tuple[int, ...], int] | None = None,
    run: dict | None = None,
    stop_reasons: dict[int, list] | None = None,
    places: dict[int, dict] | None = None,
) -> str:
    """A trace of ``batches`` written by the real TraceWriter; ``updates``: UpdateCaptures per step;
    ``stop_reasons``: the rollout engine's per sample, per step (absent: the engine said none);
    ``truncations``: the estimate's Truncation per step (absent: terminal); ``ends``: (EOS ids,
    max_response_length), for the prompt table's end flags; ``run``: more fields of the run record
    (``finished``, ``planned_steps``, ``rollout``, ``mode``: by default the record does not say); ``places``: per
    step, StepCapture's policy_versions, global_step, substep and trainer_version (format 11)."""
    options = TraceOptions(dir=str(directory), max_samples_per_step=max_samples)
    run_record = RunRecord(
        verl_ext_version="test",
        verl_version="0.9.1",
        trainer="legacy",
        created_at="2026-01-01T00:00:00+00:00",
        algorithm=algo,
        model_path=tokenizer_path,
        tokenizer_path=tokenizer_path,
        rollout_n=1,
        trace=options.as_dict(),
        update=update_settings or {},
        **(run or {}),
    )
    with TraceWriter(options, run_record) as writer:
        for step, b in batches.items():
            floats = dict(
                score=b.scores, reward=b.rewards, value=b.values, advantage=b.advantages,
                advantage_raw=b.advantage_raw, kl=b.kl, turn_score=b.turn_score, tool_reward=b.tool_reward,
                old_log_prob=b.old_log_prob, rollout_log_prob=b.rollout_log_prob, rollout_is_weight=b.rollout_is_weight,
            )  # fmt: skip
            floats["return"] = b.returns
            writer.submit(
                StepCapture(
                    step=step,
                    mask=b.mask,
                    token_id=b.responses,
                    uid=[f"u{i}" for i in range(len(b.mask))],
                    floats=floats,
                    prompts=b.prompts,
                    prompt_mask=b.prompt_mask,
                    kl_coef=b.kl_coef,
                    eos_token_ids=None if ends is None else ends[0],
                    max_response_length=None if ends is None else ends[1],
                    truncation=(truncations or {}).get(step),
                    stop_reasons=(stop_reasons or {}).get(step),
                    whitening=registry.whitening_statistics(b.advantage_raw, b.mask, (truncations or {}).get(step)),
                    rejected=b.rejected,
                    logged=b.logged,
                    **(places or {}).get(step, {}),
                )
            )
            for update in (updates or {}).get(step, []):
                writer.submit_update(update)
    return str(directory)


def good_trace(directory: Path, plant: bool = False, run: dict | None = None) -> str:
    """Three steps of td0 with KL and per-turn rewards in the reward (steps 1, 2, 3; step 3 also as the
    record's last), which pass the checker; ``plant``: one advantage of step 2 nudged, which the checker
    catches; ``run``: more fields of the run record (:func:`write_trace`)."""
    batches = good_batches()
    if plant:
        nudge(batches[2].advantages, 4, 6)
    return write_trace(directory, algorithm("td0", kl="kl"), batches, run=run)


def good_batches() -> dict[int, Batch]:
    """The steps of :func:`good_trace`, by step."""
    return {step: by_definition(random_batch(step, kl_coef=0.1, turn_rewards=True), "td0", gamma=1.0) for step in (1, 2, 3)}


def valid_positions(batch: Batch) -> list[tuple[int, int]]:
    return [tuple(p) for p in torch.nonzero(batch.mask).tolist()]


def nudge(tensor: torch.Tensor, sample: int, token: int, relative: float = 1e-2) -> None:
    """Change one entry by ``relative`` of its value: the planted violation."""
    tensor[sample, token] = float(tensor[sample, token]) * (1 + relative)


def rewrite_step(trace_dir: str, step: int, table=None, entry=None) -> None:
    """Replace a step's token table and/or its footer step entry: ``table(t) -> t``, ``entry(d) -> d``."""
    path = f"{trace_dir}/{token_file(step)}"
    original = pq.ParquetFile(path).read()
    metadata = dict(original.schema.metadata)
    new = table(original) if table else original
    if entry:
        key = STEP_RECORD_METADATA_KEY.encode()
        metadata[key] = json.dumps(entry(json.loads(metadata[key]))).encode()
    pq.write_table(new.replace_schema_metadata(metadata), path)
