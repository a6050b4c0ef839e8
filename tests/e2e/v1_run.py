"""The suite's one run of verl 0.9's default V1 trainer on Ray (the ``v1_run`` fixture of
tests/e2e/conftest.py), read by tests/e2e/test_v1_trace.py and tests/e2e/test_tool_on_ray.py.

It was two runs (issue 55: the Ray group's time): the arith task in verl's GPU settings with the README's
user estimator, verl's rollout correction and cut responses (HF-generate rollout), and the tool task with
per-turn rewards through verl's vLLM server (fp32). One run now holds what both tested:

* ``recipes/cpu_demo.sh`` with ``TASK=tool V1=1 ROLLOUT=vllm``, verl's own ppo_trainer.yaml (no verl_ext
  node), 4 responses per prompt: verl's ToolAgentLoop in a Ray agent-loop worker calling verl's vLLM server
  (vLLM's CPU build) turn by turn, ``+verl_ext.turn_rewards=true`` (the calculator's reward on the calling
  turn's last token), the KL in the reward;
* the trainer in verl's GPU settings (``PRECISION=bf16`` and tests/e2e/gpu_world.py: bf16, packed sequences,
  entropy in the loss, dynamic batch size), two PPO epochs of two shuffled mini-batches; vLLM computes in fp32
  (``rollout.dtype=float32``, which PRECISION=bf16 would set to bfloat16): its log-probs can then be held to an
  fp32 forward pass of the same weights to < 1e-5, and the bf16 trainer's old log-probs differ from them by
  bf16's rounding, which verl's rollout correction acts on (as the bf16 trainer against the float64 HF-generate
  rollout did);
* the README's ``td_half`` from a module in the directory the recipe is started from (issue 43), loaded in
  every process with the suite's capture plugin (tests/e2e/v1_capture.py) through VERL_USE_EXTERNAL_MODULES:
  the user's estimator trains. (``turn_gae``, which the tool run trained, asks nothing else of the V1 trainer:
  the seam, the agent-loop record and the turn rewards are the same for any estimator. It runs on this run's
  step 2 through ``verl-ext replay`` with the model instead, tests/e2e/test_tool_on_ray.py);
* ``+algorithm.truncation=bootstrap`` with ``data.max_response_length=26`` (:data:`CUT_AT`);
* verl's rollout correction :data:`CORRECTION`; a checkpoint after every step (for ``verl-ext replay``);
  a validation before training on :data:`VALIDATED` prompts.

Covers no module by itself (what the run covers: the two test files' docstrings).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_demo.sh"
STEPS = 2
#: responses per prompt: 8 prompts a step, 64 responses in all, of which about 3 in 10 call the tool
ROLLOUT_N = 4
#: the held-out prompts validated before training (of the task's 60): verl's V1 validation runs, cheaply
VALIDATED = 8
#: data.max_response_length: a response that calls the tool is its call (10-12 tokens), the tool's message
#: (6 tokens, 7 for a three-digit sum, 8 for four) and the answer ("等于123，是的！" and EOS: 9 tokens, 10 for a
#: three-digit sum): at 26 a call on two-digit numbers whose sum has three digits loses its EOS and nothing else,
#: longer ones lose more of their answer, a two-digit sum's (25 tokens) ends; a response without a call (about 10
#: tokens) ends
CUT_AT = 26
#: verl's rollout correction on the V1 trainer (docs/definitions.md#off-policy-tokens), in the modes the legacy
#: trainer's td0 run leaves out: one weight per sequence, exp(Σ ℓ_t), truncated at 2, and two rejections chained,
#: each token off the ratio 1 by more than 0.5% and each response whose largest ½ℓ_t² exceeds 2e-4 (|ℓ_t| > 0.02;
#: the bf16 trainer and the fp32 rollout disagree by about 2e-3 at the median, up to about 0.1 on this task's
#: longer responses: about a fifth of the policy's tokens rejected, a few responses whole)
CORRECTION = {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.995_1.005,2e-4"}
KL_COEF = 0.05


def make_v1_run(out: Path, assets_dir: Path, ray_cluster) -> Path:
    """Run the recipe into ``out`` (its outputs, the capture in ``out/captured``, the recipe's output in
    ``out/output.log``); returns ``out``."""
    from tests.cpu.helpers import run
    from tests.e2e.gpu_world import GPU_WORLD_OVERRIDES
    from tests.e2e.test_fit_with_trace import UPDATE_OVERRIDES, user_module_env
    from verl_ext.cpu.overrides import merge_overrides

    capture = out / "captured"
    capture.mkdir()
    user = user_module_env(out)
    overrides = [
        "algorithm.use_kl_in_reward=True",
        f"algorithm.kl_ctrl.kl_coef={KL_COEF}",
        f"+verl_ext.trace.dir={out / 'trace'}",  # verl's own config has no verl_ext node
        "+verl_ext.turn_rewards=true",
        # two PPO epochs of two shuffled mini-batches (the recipe's learning rate: at UPDATE_OVERRIDES' 1e-2 the
        # four updates of step 1 left a policy that called no tool and ran every response to the limit)
        *merge_overrides([o for o in UPDATE_OVERRIDES if not o.startswith("actor_rollout_ref.actor.optim.lr=")], GPU_WORLD_OVERRIDES),
        "actor_rollout_ref.rollout.dtype=float32",  # vLLM in fp32 (PRECISION=bf16 gives it bfloat16)
        # responses cut at the length limit bootstrap from V(s_L), which verl's V1 trainer computes and drops
        "+algorithm.truncation=bootstrap",
        f"data.max_response_length={CUT_AT}",
        f"data.val_max_samples={VALIDATED}",
        "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='tests.e2e.v1_capture,my_estimators'",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_EXT_TEST_CAPTURE_DIR='{capture}'",
        "trainer.save_freq=1",  # a checkpoint after every step, for verl-ext replay with the model
        *(f"algorithm.rollout_correction.{key}='{value}'" for key, value in CORRECTION.items()),
        *ray_cluster.v1_overrides,
    ]
    env = {
        **os.environ, **user, "PYTHON": sys.executable, "OUTPUT_DIR": str(out), "VERL_EXT_CPU_ASSETS": str(assets_dir),
        "TASK": "tool", "V1": "1", "ROLLOUT": "vllm", "PRECISION": "bf16", "ESTIMATOR": "td_half",
        "ROLLOUT_N": str(ROLLOUT_N), "STEPS": str(STEPS), "RAY_ADDRESS": ray_cluster.address,
    }  # fmt: skip
    # issue 43: the user's module sits in the directory the recipe is started from, as docs/estimators.md has it; only
    # the suite's own capture module is on PYTHONPATH (the recipe puts that directory first, for every process)
    env["PYTHONPATH"] = str(ROOT)
    completed = run(["bash", str(RECIPE), *overrides], env, out / "user", timeout=600)
    (out / "output.log").write_text(completed.stdout + completed.stderr)
    return out


def cut_rows(batch):
    """(B,) bool: the responses of a batch of the run (``responses``, ``loss_mask``) cut at :data:`CUT_AT`, by the
    definition (docs/definitions.md#truncated-responses): the policy's last token at the limit and not EOS. The policy's
    tokens are V1's loss mask, the response mask before verl's rejection: a response whose last tokens were rejected
    still ran to the limit (docs/definitions.md#off-policy-tokens)."""
    import tests.support.reference as ref
    from verl_ext.tasks.tool.assets import build_tool_tokenizer

    return ref.cut_rows(batch["responses"], batch["loss_mask"], {build_tool_tokenizer().eos_token_id}, CUT_AT)
