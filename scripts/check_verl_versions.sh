#!/usr/bin/env bash
# Which verl releases verl-ext's estimators and seam work with (not part of CI: it installs
# one virtual environment per verl version under .venvs/, about 1 GB each).
#
#   scripts/check_verl_versions.sh [VERSION ...]     default: the verl setup.cfg pins
#
# A release outside setup.cfg's verl requirement (0.6.1, 0.7.1 and 0.8.0 were tried this way) is
# checked by naming it; see docs/gpu.md#supported-verl-versions for how one is accepted.
# Each venv gets torch ($TORCH_SPEC, default the Makefile's), verl==VERSION with what its PPO path
# imports (TransferQueue as setup.cfg's verl-runtime extra pins it), and this
# package without dependencies; then the estimator and seam tests run against that verl.
# Tests that need a newer verl (V1 trainer, entry-point plugins) skip themselves with a reason.
# Prints one line per version and writes the full log to .venvs/verl-VERSION/tests.log.
set -uo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC=${TORCH_SPEC:-$(sed -n 's/^TORCH_SPEC ?= //p' Makefile)}
TRANSFER_QUEUE=$(grep -io '^ *transferqueue[=<>!~].*' setup.cfg | tr -d ' ')
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=("$(sed -n 's/^ *verl==//p' setup.cfg)")
summary=()
for version in "${versions[@]}"; do
    venv=.venvs/verl-$version
    log=$venv/tests.log
    echo "== verl $version: setting up $venv"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    extras=(cachetools uvicorn fastapi)
    if [[ $version == 0.9.* ]]; then
        extras+=("$TRANSFER_QUEUE")
    else
        # the libraries of their release time: verl < 0.9 imports classes transformers 5 removed,
        # and pins numpy < 2, which pyarrow >= 22 no longer supports
        extras+=("transformers<5" "pyarrow<22")
    fi
    if ! { "$venv/bin/python" -m pip install --quiet --upgrade pip &&
           { "$venv/bin/python" -c "import torch" 2>/dev/null || "$venv/bin/python" -m pip install --quiet "$TORCH_SPEC"; } &&
           "$venv/bin/python" -m pip install --quiet "verl==$version" "${extras[@]}" pytest pytest-xdist hypothesis &&
           "$venv/bin/python" -m pip install --quiet --no-deps -e .; } > "$venv/install.log" 2>&1; then
        summary+=("verl $version: INSTALL FAILED (see $venv/install.log)")
        continue
    fi
    echo "== verl $version: running tests"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_estimators.py tests/integration > "$log" 2>&1
    status=$?
    result=$(tail -n 1 "$log")
    if [ $status -eq 0 ]; then summary+=("verl $version: PASS  $result"); else summary+=("verl $version: FAIL  $result (see $log)"); fi
done
echo
printf '%s\n' "${summary[@]}"
