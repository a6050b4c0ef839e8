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


TRAINER = """
import os, sys, time
stop, stubborn = os.environ["VERL_EXT_STOP_FILE"], len(sys.argv) > 1
print("Training from scratch", flush=True)
try:
    for step in range(1, 1000):
        if os.path.exists(stop) and not stubborn:
            sys.exit(1)  # as verl's driver ends on verl-ext's StopRequested
        print(f"step:{step} - critic/score/mean:0.5", flush=True)
        time.sleep(0.05)
except KeyboardInterrupt:
    print("interrupted at once", flush=True)
    sys.exit(2)
"""


def _run_with_signals(tmp_path, signals: list[int], *trainer_args: str):
    """run_trainer on a stand-in trainer that stops before its next step once its stop file exists
    (verl_ext.stopping), with ``signals`` sent to this process once it trained a few steps."""
    import os
    import signal
    import sys
    import threading
    import time

    from verl_ext.apps.progress import run_trainer

    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    stop_file = tmp_path / ".verl-ext.stop"
    log = tmp_path / "train.log"

    def send():
        while "step:3 " not in (log.read_text() if log.exists() else ""):
            time.sleep(0.02)
        for signum in signals:
            os.kill(os.getpid(), signum)
            time.sleep(0.3)

    sender = threading.Thread(target=send)
    sender.start()
    env = {**os.environ, "VERL_EXT_STOP_FILE": str(stop_file)}
    result = run_trainer([sys.executable, str(script), *trainer_args], log, steps=1000, out=io.StringIO(), stop_file=stop_file, env=env)
    sender.join()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # this process' handlers are back
    assert not stop_file.exists()
    return result, log.read_text()


def test_the_first_signal_asks_the_trainer_to_stop_between_two_steps_and_says_where(tmp_path):
    import signal

    (status, line), log = _run_with_signals(tmp_path, [signal.SIGTERM])
    last = max(int(row.split(":")[1].split()[0]) for row in log.splitlines() if row.startswith("step:"))
    assert status == 130 and line == f"stopped by SIGTERM after step {last} of 1000: every finished step is in {tmp_path}"
    assert "interrupted at once" not in log


def test_a_second_signal_stops_the_trainer_at_once(tmp_path):
    import signal

    (status, line), log = _run_with_signals(tmp_path, [signal.SIGINT, signal.SIGINT], "stubborn")
    assert status == 130 and line.startswith("stopped by SIGINT after step ")
    assert log.rstrip().endswith("interrupted at once")  # the second signal reached it as SIGINT
