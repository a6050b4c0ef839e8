"""``verl-ext replay``: its arguments and its run."""

from __future__ import annotations

import argparse
import sys

from verl_ext.apps import replay_model
from verl_ext.apps.replay import ACTOR_OVERRIDES, Overrides, ReplayError, replay_report, replay_step, write_replay
from verl_ext.cli.common import at_least, emit, run_argument, say
from verl_ext.cli.traces import open_run
from verl_ext.errors import UsageError


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "With the model (when the run saved checkpoints, trainer.save_freq): verl's actor and critic from the checkpoint "
        "before the step, updated by verl's own update methods on the step's batch rebuilt from the trace; the verdict "
        "compares the update tables and the parameters after the step with verl's checkpoint of the step. Model-free "
        "(without a checkpoint, or --model-free): the first mini-batch of PPO epoch 0, scored again by verl's policy loss "
        "from the recorded inputs. Without overrides the verdict is REPRODUCED or the first token and column that differ; "
        "overrides give the what-if beside the recorded update (with the model: any actor_rollout_ref.* or critic.* key, "
        f"and algorithm.*; model-free: {', '.join(ACTOR_OVERRIDES)}, algorithm.*; algorithm.rollout_correction.* recomputes "
        "verl's weights and rejection from the recorded log-probs). Exit code: 0 reproduced, 1 the "
        "recorded update differs, 2 bad input or a replay that cannot be done. docs/inspecting.md#replaying-a-step"
    )
    run_argument(parser)
    parser.add_argument("--step", type=at_least(1), required=True, help="the training step to replay")
    parser.add_argument(
        "--checkpoint", metavar="DIR",
        help="the run's checkpoint directory, holding global_step_<n> (default: the run's trainer.default_local_dir)",
    )  # fmt: skip
    parser.add_argument("--model-free", action="store_true", help="replay the first mini-batch from the trace alone, even with a checkpoint")
    parser.add_argument("--out", metavar="DIR", help="write the replayed step there as a trace (check, show and view read it)")
    parser.add_argument("--top", type=at_least(0), default=10, help="tokens listed that moved most (default: 10)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    parser.add_argument("overrides", nargs="*", help="after --: key=value, e.g. -- actor_rollout_ref.actor.clip_ratio_high=0.28 algorithm.adv_estimator=td0")


def run(args: argparse.Namespace) -> int:
    trace = open_run(args.run)
    if args.checkpoint is not None and args.model_free:
        raise UsageError("--checkpoint and --model-free: choose one")
    trace.require_step(args.step)
    root = replay_model.checkpoint_root(trace, args.checkpoint)
    with_model = not args.model_free and (args.checkpoint is not None or replay_model.has_checkpoint_for(root, args.step, trace))
    try:
        if with_model:
            def progress(line: str) -> None:
                print(f"replay: {line}", file=sys.stderr, flush=True)

            result = replay_model.replay_with_model(trace, args.step, Overrides.parse(args.overrides, model=True), root, progress)
            report = replay_model.model_report(result, args.format, args.top)
            write = replay_model.write_model_replay
        else:
            if not args.model_free:
                say([_why_model_free(trace, args.step, root)])
            result = replay_step(trace, args.step, Overrides.parse(args.overrides))
            report, write = replay_report(result, args.format, args.top), write_replay
        if args.out:
            write(result, trace, args.out)
    except ReplayError as error:
        raise UsageError(str(error)) from None
    emit(report)
    if args.out and args.format == "text":
        emit(f"written: {args.out} (verl-ext check {args.out}; verl-ext show {args.out} --step {args.step} --epoch 0)")
    return 0 if result.reproduced else 1


def _why_model_free(trace, step: int, root) -> str:
    """Why the replay of ``step`` goes without the model, where no option said so: one line."""
    if root is None:
        return "the trace records no checkpoint directory (a trace before format 9): model-free"
    try:
        before = replay_model.update_checkpoints(trace, step).before
    except ReplayError as error:  # an asynchronous run's update whose start no checkpoint holds
        return f"{error}: model-free"
    return f"no checkpoint of step {before} under {root}: model-free (give --checkpoint DIR)"
