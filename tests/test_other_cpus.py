"""Another CPU, emulated: torch's ``ATEN_CPU_CAPABILITY``, oneDNN's ``ONEDNN_MAX_CPU_ISA`` and MKL's
``MKL_ENABLE_INSTRUCTIONS`` make torch compute as a machine with narrower vector units would (its
sums in another order). verl-ext's estimators and whitening computed so in float32, as a run computes
them, pass ``verl-ext check``, whose tolerances (docs/definitions.md#tolerances) bound the producer's
own rounding whatever the kernels; and the two give other bits, so the emulation took effect. One
fresh interpreter per capability (tests/support/capped_cpu.py), both at once.

Covers: verl_ext.check's tolerances on verl_ext.estimators and verl_ext.kernels under other kernels."""

from __future__ import annotations

import json
import os
import subprocess

from tests.support.forkserver import real_python

#: torch's name of each capability, and the environment that caps torch, oneDNN and MKL at it.
CAPPED = {
    "DEFAULT": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "AVX2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


def test_the_estimators_on_another_cpus_kernels_pass_the_check(tmp_path):
    children = {
        capability: subprocess.Popen(
            [real_python(), "-m", "tests.support.capped_cpu", str(tmp_path / capability)],  # a real interpreter: its own torch
            env={**os.environ, **variables}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for capability, variables in CAPPED.items()
    }
    results = {}
    for capability, child in children.items():
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-3000:]
        results[capability] = json.loads(out.splitlines()[-1])
    for capability, result in results.items():
        assert result["capability"] == capability  # the variables reached the child's torch
        assert set(result["verdicts"].values()) == {"pass"}, (capability, result["failures"])
    # the scalar kernels sum in another order than AVX2's vector units: other bits (this machine's
    # own kernels are the rest of the suite's)
    assert results["DEFAULT"]["digest"] != results["AVX2"]["digest"]
