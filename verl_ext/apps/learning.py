"""One learning run on the CPU task: verl's real trainer, in process, from the warm start.

The recipe (:func:`learning_overrides`) is shared by ``make demo`` and ``verl-ext study``: 32
prompts × 4 samples per step (128 responses), one PPO epoch in two mini-batches (two actor and two
critic updates per step), the actor at lr 3e-4 after a 5-step warm-up with a cosine decay to 0.1 of
it at the last step, the critic started from the value-pretrained critic of the assets
(:mod:`verl_ext.tasks.arith.value_pretraining`) at lr 1e-4 (with ``--fresh-critic``: the warm start with
verl's fresh value head at lr 1e-3, the recipe before value pretraining), no KL. Validation is
verl's own on the 60 held-out prompts, **sampled** (temperature 1, 8 samples each): the accuracy of
what the policy does, not of its greedy answer (greedy is near its best already after the warm
start; see :mod:`verl_ext.tasks.arith.warm_start`). Rollouts are seeded per request
(``rollout.full_determinism``), so a run is reproducible given its seed.

Each estimator gets the options it needs (:data:`ESTIMATOR_OPTIONS`); every run sees the same
prompts, responses per step, seeds and step budget.

From a shell (one run per process: verl's registries and the CPU backend are process-global)::

    python -m verl_ext.apps.learning OUTPUT_DIR --estimator mc --seed 0 --steps 40 [--task tool] [--trace] [--precision bf16] [--rollout vllm] [--fresh-critic] [-- OVERRIDE ...]

writes ``OUTPUT_DIR/metrics.jsonl`` (verl's metrics, one line per step), ``train.log`` and, with
``--trace``, the per-token trace in ``OUTPUT_DIR/trace``; an earlier run's (:data:`RUN_OUTPUTS`) are
moved to ``OUTPUT_DIR/earlier/<UTC time>/`` first.

With ``--rollout vllm`` the responses come from verl's own vLLM server (:mod:`verl_ext.cpu.vllm_rollout`),
a Ray actor beside the in-process trainer (on the cluster ``RAY_ADDRESS`` names, else a local one),
with the same recipe. vLLM samples from its engine's seeded stream in the order requests reach it, so
such a run is not bit-for-bit reproducible (the in-process HF-generate rollout seeds every request).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

from verl_ext.hf_rollout import ROLLOUT_NAME
from verl_ext.options import STOP_FILE_ENV
from verl_ext.tasks import DEFAULT_TASK, TASKS, get_task

STEPS = get_task(DEFAULT_TASK).steps
#: verl-ext's trainer config (verl's ppo_trainer and verl-ext's keys), which a learning run composes.
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CONFIG_NAME = "verl_ext_trainer"
#: What a learning run writes in its output directory; an earlier run's are moved aside first
#: (:func:`verl_ext.apps.output_lock.keep_earlier_run`).
RUN_OUTPUTS = ("trace", "metrics.jsonl", "checkpoints")
#: Validation every TEST_FREQ steps (and before training).
TEST_FREQ = 10
PROMPTS_PER_STEP = 32
SAMPLES_PER_PROMPT = 4
#: verl's validation: each held-out prompt of the task (its assets' ``val_problems``) sampled this often.
VAL_SAMPLES = 8
#: The pretrained critic's learning rate in RL: low enough to keep what pretraining built. Offline,
#: 3e-4 learns the outcome, 1e-3 is noisy, ≥ 3e-3 collapses to a constant (issue 15); in RL (mc,
#: seed 0, 40 steps) 3e-4 let the explained variance after the verdict sink to 0.53 over the last
#: 10 steps as the actor's wrong verdicts became rare, 1e-4 kept 0.59.
CRITIC_LR = 1e-4
#: The options each estimator runs with (documented in docs/study.md#in-training-verl-ext-study).
ESTIMATOR_OPTIONS: dict[str, list[str]] = {
    "mc": [],
    "td0": [],
    "nstep": ["algorithm.n_step=3"],
    "gae_ext": ["algorithm.lam_critic=1.0", "algorithm.lam_actor=0.95"],
    "gae": ["algorithm.lam=0.95"],
    # critic-free: the baseline is the mean score of the prompt's group of SAMPLES_PER_PROMPT responses
    "grpo": [],
    # λ = 0 between turns: a turn's advantage is R_k + V(next turn's start) − V(its start), so the call
    # turn is credited by the critic's value of having called, apart from how the verdict turn went
    # (on single-turn responses every λ gives G − V(s_0)); the critic's target stays the Monte-Carlo
    # return (λ_critic = 1: with λ's 0 it would learn its own bootstrapped targets, as td0's does).
    # docs/tasks.md, the tool task's critic
    "turn_gae": ["algorithm.lam=0.0", "algorithm.lam_critic=1.0"],
}


def recipe(estimator: str) -> list[str]:
    """The options ``estimator`` runs with: its own (:data:`ESTIMATOR_OPTIONS`), else none (the
    default recipe: its options at their defaults)."""
    return ESTIMATOR_OPTIONS.get(estimator, [])


def learning_overrides(
    output_dir: str | os.PathLike,
    estimator: str,
    seed: int,
    steps: int,
    test_freq: int,
    pretrained_critic: bool = True,
    extra: list[str] = (),
    task: str = DEFAULT_TASK,
    precision: str = "fp32",
    rollout: str = ROLLOUT_NAME,
) -> list[str]:
    """The hydra overrides of one learning run (CPU settings from :func:`cpu_overrides` included),
    ``extra`` last (they win).

    ``task``: the name of the task whose assets to train on (:data:`verl_ext.tasks.TASKS`).
    ``precision``: the CPU backend's (:data:`verl_ext.cpu.overrides.PRECISIONS`).
    ``rollout``: one of :data:`verl_ext.cpu.overrides.ROLLOUTS`.
    ``pretrained_critic``: start verl's critic from the value-pretrained one of the assets when the
    task has one (else from the warm start with a fresh value head, the control of the study). The
    mini- and micro-batch sizes follow the prompts per step and samples per prompt the run ends up with
    (``data.train_batch_size`` and ``actor_rollout_ref.rollout.n`` in ``extra``), so that changing
    those alone gives a valid run."""
    from verl_ext.cpu.overrides import cpu_overrides, merge_overrides, override_key

    given = {override_key(o): o.split("=", 1)[1] for o in extra if "=" in o}
    prompts = _positive_int(given, "data.train_batch_size", PROMPTS_PER_STEP)
    samples = _positive_int(given, "actor_rollout_ref.rollout.n", SAMPLES_PER_PROMPT)
    mini_batch = prompts // 2 if prompts % 2 == 0 else prompts  # two updates per step when it divides
    trained_on = get_task(task)
    assets = trained_on.build_assets()
    base = cpu_overrides(
        assets,
        output_dir,
        steps=steps,
        estimator=estimator,
        train_batch_size=prompts,
        rollout_n=samples,
        response_length=12,
        use_ray=False,
        seed=seed,
        precision=precision,
        rollout=rollout,
    )
    settings = [
        # the actor's lr: the CPU backend's 3e-4
        "actor_rollout_ref.actor.optim.lr_warmup_steps=5",  # Adam's first steps are large: ramp up
        "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",  # then decay, to 0.1 at the last step
        "actor_rollout_ref.actor.optim.min_lr_ratio=0.1",
        # two actor updates per step (when the batch divides): the second sees a policy that moved,
        # so ratios leave 1 and some tokens clip
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mini_batch * samples}",
        f"critic.ppo_mini_batch_size={mini_batch}",
        f"critic.ppo_micro_batch_size_per_gpu={mini_batch * samples}",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        f"actor_rollout_ref.rollout.val_kwargs.n={VAL_SAMPLES}",
        "trainer.val_before_train=True",
        f"trainer.test_freq={test_freq}",
    ]
    if pretrained_critic and trained_on.pretrained_critic:  # else the warm start with a fresh value head, at cpu_overrides' lr 1e-3
        settings += [f"critic.model.path={assets.critic_dir}", f"critic.optim.lr={CRITIC_LR}"]
    return merge_overrides(base, settings, recipe(estimator), list(extra))


def _positive_int(given: dict[str, str], key: str, default: int) -> int:
    from verl_ext.errors import UsageError

    text = given.get(key, str(default))
    if not text.isdigit() or int(text) < 1:
        raise UsageError(f"{key} must be an integer >= 1, got {text!r}")
    return int(text)


def run(
    output_dir: Path, estimator: str, seed: int, steps: int, test_freq: int, trace: bool, extra: list[str],
    pretrained_critic: bool = True, task: str = DEFAULT_TASK, precision: str = "fp32", rollout: str = ROLLOUT_NAME,
) -> None:
    """Train in this process (the CPU backend is activated here; verl's vLLM server, with
    ``rollout="vllm"``, a Ray actor beside it). Holds
    ``output_dir``'s lock (or the one the command that started it holds: :mod:`verl_ext.apps.output_lock`)
    before it touches anything there. The run stops between two steps once its stop file exists
    (:mod:`verl_ext.stopping`): in process, :class:`~verl_ext.stopping.StopRequested` comes out of here."""
    from verl_ext.apps.output_lock import keep_earlier_run, output_lock
    from verl_ext.cpu.overrides import cpu_environment

    with output_lock(output_dir, "python -m verl_ext.apps.learning"):
        keep_earlier_run(output_dir, RUN_OUTPUTS, "[learning]")
        environment = cpu_environment(output_dir)
        overrides = run_overrides(output_dir, estimator, seed, steps, test_freq, trace, extra, pretrained_critic, task, precision, rollout)
        for name in ("VERL_FILE_LOGGER_PATH", STOP_FILE_ENV):  # what the in-process trainer reads of a CPU run's environment
            os.environ[name] = environment[name]
        _train_in_process(overrides, CONFIGS, seed)


def run_overrides(
    output_dir: Path, estimator: str, seed: int, steps: int, test_freq: int, trace: bool, extra: list[str],
    pretrained_critic: bool = True, task: str = DEFAULT_TASK, precision: str = "fp32", rollout: str = ROLLOUT_NAME,
) -> list[str]:
    """The overrides :func:`run` trains with (:func:`learning_overrides`, and the trace in ``output_dir/trace``)."""
    from verl_ext.cpu.overrides import merge_overrides

    overrides = learning_overrides(output_dir, estimator, seed, steps, test_freq, pretrained_critic, extra, task, precision, rollout)
    if trace:
        overrides = merge_overrides([f"verl_ext.trace.dir={output_dir / 'trace'}"], overrides)
    return overrides


def check_run(output_dir: Path, estimator: str, seed: int, steps: int, test_freq: int, trace: bool, extra: list[str],
              pretrained_critic: bool = True, task: str = DEFAULT_TASK, precision: str = "fp32", rollout: str = ROLLOUT_NAME) -> None:  # fmt: skip
    """The config :func:`run` would train with, composed and checked as its driver checks it
    (:func:`verl_ext.apps.composition.checked_config`), without writing anything: what ``verl-ext demo``
    calls before it creates a folder. UsageError, one line."""
    from verl_ext.apps.composition import checked_config

    overrides = run_overrides(output_dir, estimator, seed, steps, test_freq, trace, extra, pretrained_critic, task, precision, rollout)
    checked_config(overrides, CONFIGS, CONFIG_NAME)


def _train_in_process(overrides: list[str], configs: Path, seed: int) -> None:
    import numpy as np
    import torch

    import verl_ext.cpu

    verl_ext.cpu.activate()
    from verl_ext.cpu.in_process import run_in_process

    # verl seeds neither torch nor numpy for the FSDP engine: the critic's fresh value head would
    # differ from run to run. One intra-op thread: threads buy nothing on this model, and results
    # then do not depend on the machine's core count.
    torch.set_num_threads(1)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    run_in_process(overrides, config_dir=configs, config_name=CONFIG_NAME)


def read_metrics(output_dir: Path) -> dict[int, dict]:
    """step -> verl's metrics of that step, from a run's ``metrics.jsonl`` (verl's file logger, one
    JSON line per step, validation included); empty when there is no file."""
    from verl_ext.cpu.overrides import METRICS_FILE

    path = Path(output_dir) / METRICS_FILE
    lines = path.read_text().splitlines() if path.exists() else []
    return {record["step"]: record["data"] for record in map(json.loads, lines)}


def validation_setting(task: str = DEFAULT_TASK) -> str:
    """How verl's validation samples, in words (for reports)."""
    problems = get_task(task).asset_spec().val_problems
    return f"{problems} prompts × {VAL_SAMPLES} samples at temperature 1"


def validation_accuracy(metrics: dict[int, dict]) -> dict[int, float]:
    """step -> verl's held-out ``val-core/<data_source>/acc/mean@<n>``, at the steps that validated."""
    return {
        step: value
        for step, data in metrics.items()
        for key, value in data.items()
        if key.startswith("val-core/") and "/acc/mean@" in key
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    from verl_ext.cpu.overrides import add_precision_argument, add_rollout_argument

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--estimator", default="mc")
    parser.add_argument("--task", choices=tuple(TASKS), default=DEFAULT_TASK, help=f"whose assets (default {DEFAULT_TASK})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--test-freq", type=int, default=TEST_FREQ, help="validate every N steps (and before training)")
    parser.add_argument("--trace", action="store_true", help="write the per-token trace to OUTPUT_DIR/trace")
    add_precision_argument(parser)
    add_rollout_argument(parser)
    parser.add_argument(
        "--fresh-critic", action="store_true",
        help="start the critic from the warm start with a fresh value head instead of the pretrained critic",
    )  # fmt: skip
    args = parser.parse_args(own)
    from verl_ext.errors import UsageError
    from verl_ext.stopping import INTERRUPTED, StopRequested

    try:
        run(
            args.output_dir.resolve(), args.estimator, args.seed, args.steps, args.test_freq, args.trace, extra,
            pretrained_critic=not args.fresh_critic, task=args.task, precision=args.precision, rollout=args.rollout,
        )  # fmt: skip
    except StopRequested as stop:
        print(f"[learning] {stop}", file=sys.stderr)
        return INTERRUPTED
    except UsageError as error:  # e.g. the output directory is another run's
        print(f"[learning] {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
