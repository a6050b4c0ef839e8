#!/usr/bin/env bash
# PPO with Monte-Carlo returns minus values (verl-ext `mc`): the return G_t of the sampled
# response is the critic's target and G_t - V(s_t) the advantage. Unbiased, high variance.
set -euo pipefail
source "$(dirname "$0")/gsm8k_common.sh"
run_recipe mc algorithm.adv_estimator=mc algorithm.gamma=1.0 -- "$@"
