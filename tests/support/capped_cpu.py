"""Run by tests/test_other_cpus.py in a fresh interpreter whose torch computes as another CPU would
(``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``): one step of each of
verl-ext's estimators whose sums a CPU's vector width reorders (mc, gae_ext with the length-adaptive
λ, turn_gae; the whitening over the batch), computed in float32 as a run computes it, on a batch of
long responses with holes and KL in the reward, written as a trace and checked.

``python -m tests.support.capped_cpu OUTPUT_DIR`` prints one JSON line: torch's CPU capability, a
digest of the float32 numbers computed, each estimator's check verdict and the check's first failure.

Covers no module by itself: it feeds tests/test_other_cpus.py's check of verl_ext.check's tolerances."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

#: The estimators and options of the step: (name, gamma, lam, options).
ESTIMATORS = (
    ("mc", 1.0, 1.0, {}),
    ("gae_ext", 0.99, 0.95, {"lam_critic": 1.0, "lam_length_alpha": 0.05}),
    ("turn_gae", 1.0, 0.9, {"lam_critic": 1.0}),
)


def main(output: Path) -> dict:
    import torch

    from tests.inspect.inspect_helpers import algorithm, random_batch, write_trace
    from verl_ext import registry
    from verl_ext.check.run import check_trace

    batch = random_batch(7, B=64, T=1024, kl_coef=0.1, holes=3)
    digest, verdicts, failures = hashlib.sha256(), {}, {}
    for name, gamma, lam, options in ESTIMATORS:
        entry = registry.get(name)
        settings = entry.settings({"gamma": gamma, "lam": lam, "whiten_advantages": True, **options})
        estimate = registry.run(entry, batch.rewards, batch.values, batch.mask, settings)
        for tensor in (estimate.returns, estimate.advantage_raw, estimate.advantages):
            digest.update(tensor.numpy().tobytes())
        step = replace(batch, returns=estimate.returns, advantage_raw=estimate.advantage_raw, advantages=estimate.advantages)
        report = check_trace(write_trace(output / name, algorithm(name, gamma, lam, kl="kl", **options), {1: step}))
        verdicts[name] = report.verdict
        failures[name] = [f"{r.identity}: {r.first}" for r in report.per_step if r.status == "fail"][:1]
    return {"capability": torch.backends.cpu.get_cpu_capability(), "digest": digest.hexdigest(), "verdicts": verdicts, "failures": failures}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
