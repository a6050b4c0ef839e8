"""Tiny, real training assets built at run time: no model or dataset is ever downloaded.

``build_assets()`` writes, once per spec, into a cache directory:

* ``model/``: the warm-started policy. A ``llama`` model (hidden 128, 2 layers, fixed seed) is
  initialised at random and fine-tuned for a few hundred steps on the CPU task
  (:mod:`verl_ext.tasks.arith.warm_start`, ~20 s on one core), then saved with ``save_pretrained`` next to
  a character-level tokenizer built with the ``tokenizers`` library. The actor, the reference and
  the critic (with verl's fresh value head) all start from it. ``llama`` and not ``qwen2``:
  transformers 5 forces ``Qwen2Tokenizer`` for ``model_type: qwen2``, which breaks a
  character-level vocabulary; a ``llama`` config round-trips exactly.
* ``warm_start.json``: its settings, final loss, time, and held-out accuracy (greedy and sampled).
* ``critic/``: the pretrained critic (:mod:`verl_ext.tasks.arith.value_pretraining`): the warm start with
  verl's value head, trained on the warm start's own sampled answers until its held-out explained
  variance after the verdict stops improving; ``value_pretraining.json`` reports that fit and the
  time. The learning recipe starts verl's critic from it (``critic.model.path``).
* ``train.parquet`` / ``val.parquet``: "请问a+b=c？" prompts (:mod:`verl_ext.tasks.arith.task`) in verl's
  RLHFDataset schema (chat-message ``prompt``, ``reward_model.ground_truth`` = the expected answer,
  ``extra_info.index``); validation problems are held out from the warm start and from RL.
* the reward function is :mod:`verl_ext.tasks.arith.reward` (a source file verl loads by path).

``describe()`` prints what the demo shows of them before training.

The build is idempotent and safe to race (:func:`verl_ext.tasks.common.cached_build`): a finished
build is a directory named after the hash of its spec, published with an atomic rename; a second
process that asks while the first builds waits for it (a lock file beside the cache) and then reads
the cache.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from verl_ext.tasks.arith import reward
from verl_ext.tasks.arith.task import Problem, balanced_sample, problem_sets
from verl_ext.tasks.value_pretraining import ValuePretrainingSettings
from verl_ext.tasks.arith.warm_start import WarmStartSettings
from verl_ext.tasks.assets import TaskAssetSpec
from verl_ext.tasks.common import BOS, EOS, PAD, ROLE_TOKENS, UNK, cached_build, character_tokenizer, tiny_llama

#: Bump when the layout or content of the assets changes, so old caches are not reused.
ASSETS_FORMAT = 4

#: What the task and the seed dialogue ("请问1+1=2？" / "是的，等于2！") need.
CHARACTERS = "0123456789+-*/=?()., \n" + "请问是的，等于！？不"
DATA_SOURCE = "verl_ext/sum_check"


@dataclass(frozen=True)
class AssetSpec(TaskAssetSpec):
    """Everything that determines the content of the assets (hashed into the cache key): the fields
    every task has (:class:`verl_ext.tasks.assets.TaskAssetSpec`), then the warm start's and the
    critic's pretraining settings."""

    warm_start: WarmStartSettings = field(default_factory=WarmStartSettings)
    value_pretraining: ValuePretrainingSettings = field(default_factory=ValuePretrainingSettings)
    format: int = ASSETS_FORMAT


@dataclass(frozen=True)
class CpuAssets:
    """Paths of one built asset set."""

    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path
    reward_file: Path
    warm_start_report: Path
    critic_dir: Path
    value_pretraining_report: Path
    reward_name: str = "compute_score"
    #: Prompts are "<|user|>请问a+b=c？<|assistant|>" (at most 11 tokens).
    max_prompt_length: int = 16


def build_assets(cache_dir: str | os.PathLike | None = None, spec: AssetSpec = AssetSpec()) -> CpuAssets:
    """Build the assets for ``spec`` under ``cache_dir`` unless they already exist; return their paths."""
    return _paths(cached_build(cache_dir, spec, lambda staging: _build(staging, spec)))


def _build(staging: Path, spec: AssetSpec) -> None:
    train, val = _write_prompts(staging, spec)
    _write_model_and_tokenizer(staging, spec, train, val)


def _paths(target: Path) -> CpuAssets:
    return CpuAssets(
        root=target,
        model_dir=target / "model",
        train_file=target / "train.parquet",
        val_file=target / "val.parquet",
        reward_file=Path(reward.__file__).resolve(),
        warm_start_report=target / "warm_start.json",
        critic_dir=target / "critic",
        value_pretraining_report=target / "value_pretraining.json",
    )


def token_id(character: str) -> int:
    """The id of one character in the tokenizer :func:`build_tokenizer` builds, without building it."""
    return len((PAD, UNK, BOS, EOS, *ROLE_TOKENS)) + CHARACTERS.index(character)


def build_tokenizer():
    """The task's tokenizer: one token per character of :data:`CHARACTERS` (:func:`verl_ext.tasks.common.character_tokenizer`)."""
    return character_tokenizer(CHARACTERS)


def _write_model_and_tokenizer(directory: Path, spec: AssetSpec, train: list[Problem], val: list[Problem]) -> None:
    from verl_ext.tasks.arith.value_pretraining import pretrain_value
    from verl_ext.tasks.value_pretraining import save_critic
    from verl_ext.tasks.arith.warm_start import evaluate, supervised_fine_tune

    tokenizer = build_tokenizer()
    model = tiny_llama(tokenizer, spec)
    settings = spec.warm_start
    print(f"[verl-ext] building the CPU assets: warm start, {settings.steps} supervised steps (~20 s) ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    loss = supervised_fine_tune(model, tokenizer, train, settings, seed=spec.seed)
    seconds = time.monotonic() - started
    greedy = evaluate(model, tokenizer, val, greedy=True)
    sampled = evaluate(model, tokenizer, val, samples=8, greedy=False, seed=spec.seed)
    model.save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    report = {"settings": asdict(settings), "final_loss": loss, "seconds": round(seconds, 1),
              "held_out_greedy": asdict(greedy), "held_out_sampled": asdict(sampled)}  # fmt: skip
    (directory / "warm_start.json").write_text(json.dumps(report, indent=2))
    print(
        f"[verl-ext] warm start done in {seconds:.0f} s; held-out greedy: sum {greedy.sum:.2f}, verdict "
        f"{greedy.verdict:.2f}; sampled: verdict {sampled.verdict:.2f}, fully right {sampled.acc:.2f}",
        file=sys.stderr,
        flush=True,
    )
    print("[verl-ext] pretraining the critic on the warm start's own answers ...", file=sys.stderr, flush=True)
    critic, report = pretrain_value(model, tokenizer, train, val, spec.value_pretraining, seed=spec.seed)
    save_critic(directory, critic, tokenizer, report)


def prompt_row(problem: Problem, split: str, index: int) -> dict:
    """One row in verl's RLHFDataset schema, and nothing more: verl carries every column through
    every step as per-response Python objects."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.question()}],
        "reward_model": {"style": "rule", "ground_truth": problem.answer()},
        "extra_info": {"split": split, "index": index},
    }


def task_problems(spec: AssetSpec) -> tuple[list[Problem], list[Problem]]:
    """The training rows (right and wrong alternating) and the held-out validation problems."""
    sets = problem_sets(spec.seed, spec.max_delta, spec.val_problems)
    return balanced_sample(sets, spec.train_rows, spec.seed), sets.val


def _write_prompts(directory: Path, spec: AssetSpec) -> tuple[list[Problem], list[Problem]]:
    import pandas as pd

    train, val = task_problems(spec)
    for split, problems in (("train", train), ("val", val)):
        rows = [prompt_row(problem, split, index) for index, problem in enumerate(problems)]
        pd.DataFrame(rows).to_parquet(directory / f"{split}.parquet")
    return train, val


def describe() -> None:
    """The task, its warm start and its pretrained critic, as the demo shows them before training
    (the assets built first, when they are not in the cache)."""
    assets = build_assets()
    report = json.loads(assets.warm_start_report.read_text())
    right, wrong = Problem(2, 3, 5), Problem(2, 3, 6)
    print(f"  task: {right.question()} -> {right.answer()}    {wrong.question()} -> {wrong.answer()}")
    print("  reward on the last token: 1.0 fully right; else 0.2 for the right sum + 0.2 for the right verdict")
    greedy, sampled = report["held_out_greedy"], report["held_out_sampled"]
    print(
        f"  warm start ({report['settings']['steps']} supervised steps, verdict prior "
        f"{report['settings']['verdict_prior']}): held-out sum right {greedy['sum']:.2f} (greedy); "
        f"verdict right {sampled['verdict']:.2f} sampled, {greedy['verdict']:.2f} greedy"
    )
    critic = json.loads(assets.value_pretraining_report.read_text())
    fit = critic["held_out_fit"]
    print(
        f"  critic pretrained on the warm start's own answers ({critic['wrong_verdicts']:.0%} wrong verdicts, "
        f"{critic['updates']} updates): held-out explained variance {fit['ev_after_verdict']:.2f} after the verdict, "
        f"{fit['ev_before_verdict']:.2f} before it"
    )
