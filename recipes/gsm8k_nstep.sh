#!/usr/bin/env bash
# PPO with n-step bootstrapped returns (verl-ext `nstep`): n rewards, then V(s_{t+n}).
# n trades the variance of `mc` (n >= response length) against the bias of `td0` (n = 1).
set -euo pipefail
source "$(dirname "$0")/gsm8k_common.sh"
run_recipe nstep algorithm.adv_estimator=nstep algorithm.n_step=32 algorithm.gamma=1.0 -- "$@"
