# Shared settings of the GSM8K recipes (sourced, not run): Qwen2.5-0.5B-Instruct, vLLM rollout,
# FSDP actor and critic, KL in the reward, one node, the per-token trace of every 10th step.
# They use verl-ext's hydra config, which declares every key verl-ext adds (no `+` needed).
#
# Environment: MODEL_PATH (default Qwen/Qwen2.5-0.5B-Instruct), DATA_DIR with train.parquet and
# test.parquet as written by verl's examples/data_preprocess/gsm8k.py (default ~/data/gsm8k),
# GPUS (default 8), TRACE_ROOT (default ~/verl_ext_traces), PYTHON (default python3).

MODEL_PATH=${MODEL_PATH:-Qwen/Qwen2.5-0.5B-Instruct}
DATA_DIR=${DATA_DIR:-$HOME/data/gsm8k}
GPUS=${GPUS:-8}
TRACE_ROOT=${TRACE_ROOT:-$HOME/verl_ext_traces}
PYTHON=${PYTHON:-python3}

COMMON_OVERRIDES=(
    data.train_files="$DATA_DIR/train.parquet"
    data.val_files="$DATA_DIR/test.parquet"
    data.train_batch_size=256
    data.max_prompt_length=512
    data.max_response_length=512
    actor_rollout_ref.model.path="$MODEL_PATH"
    actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=64
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
    critic.model.path="$MODEL_PATH"
    critic.optim.lr=1e-5
    critic.ppo_micro_batch_size_per_gpu=8
    algorithm.use_kl_in_reward=True
    algorithm.kl_ctrl.kl_coef=0.001
    trainer.logger=[console]
    trainer.project_name=verl_ext
    trainer.n_gpus_per_node="$GPUS"
    trainer.nnodes=1
    trainer.save_freq=-1
    trainer.test_freq=10
    trainer.total_epochs=15
    verl_ext.trace.every=10
    verl_ext.trace.max_samples_per_step=64
)

# run_recipe NAME RECIPE_OVERRIDE... -- "$@"
# Runs verl's PPO trainer with the shared overrides, the recipe's and then the caller's, which
# win. With --print-overrides as the caller's first argument it prints the overrides instead.
run_recipe() {
    local name=$1 recipe=()
    shift
    while [ $# -gt 0 ] && [ "$1" != -- ]; do recipe+=("$1"); shift; done
    [ $# -gt 0 ] && shift
    local overrides=(
        "${COMMON_OVERRIDES[@]}" "${recipe[@]}"
        trainer.experiment_name="qwen2.5-0.5b_gsm8k_$name"
        verl_ext.trace.dir="$TRACE_ROOT/$name"
    )
    if [ "${1:-}" = --print-overrides ]; then
        printf '%s\n' "${overrides[@]}"
        return
    fi
    local config_dir
    config_dir=$("$PYTHON" -c "import os, verl_ext; print(os.path.join(os.path.dirname(verl_ext.__file__), 'configs'))")
    "$PYTHON" -m verl.trainer.main_ppo --config-path="$config_dir" --config-name=verl_ext_trainer \
        "${overrides[@]}" "$@"
}
