#!/usr/bin/env bash
# verl's own GAE (`gae`), unchanged, with the per-token trace on: the baseline to compare against.
set -euo pipefail
source "$(dirname "$0")/gsm8k_common.sh"
run_recipe gae algorithm.adv_estimator=gae algorithm.gamma=1.0 algorithm.lam=0.95 -- "$@"
