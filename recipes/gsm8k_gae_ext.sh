#!/usr/bin/env bash
# PPO with decoupled and length-adaptive GAE (verl-ext `gae_ext`): the critic regresses on
# λ_critic = 1 returns (VC-PPO, arXiv 2503.01491), the actor's advantages use
# λ_actor = 1 - 1/(0.05 L) per response (VAPO, arXiv 2504.05118).
set -euo pipefail
source "$(dirname "$0")/gsm8k_common.sh"
run_recipe gae_ext algorithm.adv_estimator=gae_ext algorithm.gamma=1.0 \
    algorithm.lam_critic=1.0 algorithm.lam_length_alpha=0.05 -- "$@"
