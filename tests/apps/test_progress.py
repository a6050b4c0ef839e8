"""The progress filter of CPU runs: full log kept, one readable line per event."""

from __future__ import annotations

import io

from verl_ext.apps.progress import follow

OUTPUT = [
    "2026 INFO worker.py:2029 -- Started a local Ray instance.\n",
    "(TaskRunner pid=1) TaskRunner hostname: vm, PID: 1\n",
    "(TaskRunner pid=1) step:0 - val-aux/x/score/mean@1:np.float64(0.14) - val-core/x/acc/mean@1:np.float64(0.0)"
    " - val-core/x/acc/best@4/mean:np.float64(0.75) - val-core/x/acc/best@4/std:np.float64(0.05)\n",
    "(TaskRunner pid=1) step:1 - critic/score/mean:0.0375 - critic/values/mean:-0.5 - timing_s/step:0.45\n",
    "(TaskRunner pid=1) step:2 - critic/score/mean:0.5 - verl_ext/critic/ev_mc:0.25 - verl_ext/critic/ev_mc_last:0.8125"
    " - verl_ext/credit/top_token_share:np.float64(0.375) - timing_s/step:0.5\n",
    "(TaskRunner pid=1) Traceback (most recent call last):\n",
    '  File "x.py", line 1\n',
]


def test_follow_keeps_everything_and_prints_the_events(tmp_path):
    out = io.StringIO()
    follow(iter(OUTPUT), tmp_path / "train.log", steps=5, out=out)
    assert (tmp_path / "train.log").read_text() == "".join(OUTPUT)
    printed = out.getvalue()
    assert "Ray started" in printed and "task runner up (legacy RayPPOTrainer)" in printed
    assert "[step 0/5] val acc 0.000\n" in printed  # the mean, not verl's best@n bootstrap
    assert "[step 1/5] score 0.0375  value -0.5  step_s 0.45" in printed
    assert "[step 2/5] score 0.5  ev_mc_last 0.8125  top_token_share 0.375  step_s 0.5" in printed
    assert printed.endswith('Traceback (most recent call last):\n  File "x.py", line 1\n')


def test_the_rollout_server_is_named_by_the_runs_rollout(tmp_path):
    vllm_output = [
        "(vLLMHttpServer pid=7) ['serve',\n",
        "(TaskRunner pid=1) LLMServerManager: ['10.0.0.1:4000']\n",
    ]
    printed = {}
    for rollout in ("hf_generate", "vllm"):
        out = io.StringIO()
        follow(iter(vllm_output if rollout == "vllm" else vllm_output[1:]), tmp_path / f"{rollout}.log", out=out, rollout=rollout)
        printed[rollout] = out.getvalue()
    assert "HF-generate rollout server up" in printed["hf_generate"] and "vLLM" not in printed["hf_generate"]
    assert "vLLM server starting" in printed["vllm"] and "vLLM rollout server up" in printed["vllm"]
    assert "HF-generate" not in printed["vllm"]
