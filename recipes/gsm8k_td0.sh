#!/usr/bin/env bash
# PPO with one-step TD targets (verl-ext `td0`): returns r_t + γ V(s_{t+1}), advantage δ_t.
# Lowest variance, biased towards the critic; needs a critic that has learned something.
set -euo pipefail
source "$(dirname "$0")/gsm8k_common.sh"
run_recipe td0 algorithm.adv_estimator=td0 algorithm.gamma=1.0 trainer.critic_warmup=5 -- "$@"
