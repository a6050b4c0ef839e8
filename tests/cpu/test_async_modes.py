"""verl 0.9.1's asynchronous trainers on the CPU backend, without training: what a CPU run of each needs
(verl_ext.cpu.overrides.async_overrides, through recipes/cpu_demo.sh's check, verl_ext.apps.overrides)
composes with the config its entry point composes and satisfies what verl asserts before step 1; a bad
combination is one line and exit 2; and the CPU backend's copy of π_old (fsdp2_sharded_save_to_cpu).

The runs themselves (2 steps of each, about a minute each on 2 cores) are measured in docs/cpu_backend.md,
not run here."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from omegaconf import OmegaConf

from verl_ext.apps import overrides as overrides_app
from verl_ext.cpu.overrides import (
    CHECKPOINT_ENGINE,
    CHECKPOINT_ENGINE_MODULE,
    EXPERIMENTAL_TRAINERS,
    compose_config,
    experimental_config,
)


def printed_overrides(capsys, tmp_path, *argv: str) -> list[str]:
    overrides_app.main(["--output-dir", str(tmp_path), "--steps", "2", *argv])
    return capsys.readouterr().out.splitlines()


def refusal(capsys, tmp_path, *argv: str) -> str:
    with pytest.raises(SystemExit) as refused:
        overrides_app.main(["--output-dir", str(tmp_path), "--steps", "2", *argv])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err.strip()


def assert_rollout_apart(config, num_cpus: int) -> None:
    """Every mode: the rollout on a logical GPU of its own, the weights through the CPU checkpoint engine."""
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.nnodes, rollout.n_gpus_per_node) == (1, 1)
    assert (rollout.checkpoint_engine.backend, rollout.checkpoint_engine.custom_backend_module) == (CHECKPOINT_ENGINE, CHECKPOINT_ENGINE_MODULE)
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (1, 1)
    assert (config.ray_kwargs.ray_init.num_gpus, config.ray_kwargs.ray_init.num_cpus) == (2, num_cpus)


def test_separate_async_the_user_types_the_mode_and_its_updates(assets, capsys, tmp_path):
    """V1=1 recipes/cpu_demo.sh trainer.v1.trainer_mode=separate_async trainer.v1.separate_async.parameter_sync_step=2"""
    lines = printed_overrides(
        capsys, tmp_path, "--v1", "--rollout-n", "2", "--",
        "trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2",
    )  # fmt: skip
    config = compose_config(lines)
    assert_rollout_apart(config, 8)
    # verl's PPOTrainerSeparateAsync.__init__ asserts (trainer_separate_async.py:59-70)
    assert config.data.train_batch_size == 2 * config.actor_rollout_ref.actor.ppo_mini_batch_size == 8
    assert config.actor_rollout_ref.rollout.checkpoint_engine.backend != "naive"
    # a local update sees 4 prompts of 2 responses: no micro-batch larger (verl's prepare_micro_batches)
    for key in (
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
    ):  # fmt: skip
        assert OmegaConf.select(config, key) == 8, key
    # verl's default parameter_sync_step (4) when the user names only the mode
    lines = printed_overrides(capsys, tmp_path, "--v1", "--", "trainer.v1.trainer_mode=separate_async")
    assert compose_config(lines).actor_rollout_ref.actor.ppo_mini_batch_size == 2
    # a run in verl's default mode gets none of it
    lines = printed_overrides(capsys, tmp_path, "--v1")
    assert compose_config(lines).actor_rollout_ref.rollout.checkpoint_engine.backend == "naive"


@pytest.mark.parametrize("mode", list(EXPERIMENTAL_TRAINERS))
def test_an_experimental_trainers_overrides_compose_with_its_own_config(assets, capsys, tmp_path, mode):
    """ASYNC=<mode> recipes/cpu_demo.sh: the config its entry point's hydra main composes (its yaml in verl's
    package, verl's ppo_trainer found through the package), and what its trainer asserts before step 1."""
    lines = printed_overrides(capsys, tmp_path, "--async", mode, "--estimator", "grpo", "--rollout-n", "4")
    config_dir, name = experimental_config(mode)
    assert (config_dir / f"{name}.yaml").is_file()
    config = compose_config(lines, config_dir, name)
    assert_rollout_apart(config, {"one_step_off": 16, "fully_async": 32}[mode])
    assert config.actor_rollout_ref.hybrid_engine is False  # both trainers assert it
    assert (config.rollout.nnodes, config.rollout.n_gpus_per_node) == (1, 1)  # their own resource keys
    assert config.actor_rollout_ref.rollout.calculate_log_probs and config.algorithm.rollout_correction.bypass_mode
    if mode == "one_step_off":
        assert config.actor_rollout_ref.rollout.free_cache_engine is False  # its yaml: else no weight sync
        assert config.trainer.total_training_steps == 2 and config.data.train_batch_size == 8
    else:
        # the rollouter's asserts (fully_async_rollouter.py:351-356); 2 weight versions of 8 prompts, one update each
        assert (config.data.train_batch_size, config.data.gen_batch_size) == (0, 1)
        assert config.actor_rollout_ref.actor.ppo_mini_batch_size == 8
        assert config.async_training.trigger_parameter_sync_step == 1
        assert config.rollout.total_rollout_steps == 16
        assert config.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 32
    capsys.readouterr()
    overrides_app.main(["--output-dir", str(tmp_path), "--entry-point", "--async", mode])
    assert capsys.readouterr().out.strip() == EXPERIMENTAL_TRAINERS[mode][0]


def test_fully_async_follows_the_users_updates_per_sync(assets, capsys, tmp_path):
    lines = printed_overrides(
        capsys, tmp_path, "--async", "fully_async", "--", "async_training.trigger_parameter_sync_step=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    )  # fmt: skip
    config = compose_config(lines, *experimental_config("fully_async"))
    # 2 weight versions of 2 updates of 4 prompts
    assert (config.rollout.total_rollout_steps, config.async_training.trigger_parameter_sync_step) == (16, 2)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--v1", "--async", "one_step_off"],
            "verl-ext: --async one_step_off runs verl's own trainer of that mode (verl.experimental.one_step_off_policy.main_ppo), "
            "not the V1 trainer: leave out --v1 (V1=1); V1's asynchronous mode is trainer.v1.trainer_mode=separate_async",
        ),
        (
            ["--async", "fully_async", "--config-path", "configs"],
            "verl-ext: --async fully_async composes verl's own config of that trainer: leave out --config-path (CONFIG_PATH) "
            "and add verl-ext's options as +verl_ext.<option>=<value>",
        ),
        (
            ["--", "trainer.v1.trainer_mode=separate_async"],
            "verl-ext: trainer.v1.trainer_mode=separate_async is a mode of verl's V1 trainer, which this run does not use: "
            "add trainer.use_v1=True (V1=1 for recipes/cpu_demo.sh)",
        ),
        (
            ["--v1", "--", "trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=3"],
            "verl-ext: trainer.v1.separate_async.parameter_sync_step=3 must divide data.train_batch_size=8: each of its "
            "local updates takes an equal share of the batch",
        ),
        (
            ["--v1", "--", "trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2",
             "actor_rollout_ref.actor.ppo_mini_batch_size=8"],
            "verl-ext: trainer.v1.separate_async.parameter_sync_step=2 takes actor_rollout_ref.actor.ppo_mini_batch_size=4 "
            "(data.train_batch_size=8 / 2; verl asserts it), not 8",
        ),
    ],
    ids=["v1 and an experimental trainer", "verl-ext's config", "separate_async without V1", "updates not dividing the batch", "mini-batch"],
)  # fmt: skip
def test_a_combination_that_cannot_run_is_one_line(assets, capsys, tmp_path, argv, message):
    assert refusal(capsys, tmp_path, *argv) == message


@pytest.mark.parametrize("argv", [("--v1", "--", "trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2"),
                                  ("--async", "one_step_off", "--"), ("--async", "fully_async", "--")],
                         ids=["separate_async", "one_step_off", "fully_async"])  # fmt: skip
def test_a_traced_run_of_each_mode_passes_the_recipes_check(assets, capsys, tmp_path, argv):
    """Issue 58: each mode is traced now (the check refused separate_async's sub-steps before)."""
    lines = printed_overrides(capsys, tmp_path, *argv, f"+verl_ext.trace.dir={tmp_path / 'trace'}")
    assert lines[-1] == f"+verl_ext.trace.dir={tmp_path / 'trace'}"


SAVE_AND_RESTORE = textwrap.dedent(
    """
    import json, os, socket, torch, torch.distributed as dist
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from verl.utils import fsdp_utils
    from verl_ext.cpu.patches import sharded_save_copies
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    start = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    restored = {}
    for label, save in (("verl", fsdp_utils.fsdp2_sharded_save_to_cpu), ("cpu backend", sharded_save_copies(fsdp_utils.fsdp2_sharded_save_to_cpu))):
        state, spec = save(model)  # DetachActorWorker.save_model_to_cpu: π_old of the cycle
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the optimizer's step, in place
        fsdp_utils.fsdp2_sharded_load_from_cpu(model, state, spec)  # restore_model_from_cpu
        restored[label] = all(torch.equal(p.full_tensor(), start[n]) for n, p in model.named_parameters())
        with torch.no_grad():
            for n, p in model.named_parameters():
                p._local_tensor.copy_(start[n])
    dist.destroy_process_group()
    print(json.dumps(restored))
    """
)


def test_pi_old_saved_on_a_cpu_survives_the_updates_after_it():
    """verl's asynchronous trainers keep π_old of a cycle with fsdp2_sharded_save_to_cpu, whose `.cpu()`
    copies a GPU's shard but returns a CPU's own storage: the next update changed the saved π_old (V1
    separate_async logged rollout_probs_diff_mean 0.0097 at staleness 0 before, 0.0 after)."""
    completed = subprocess.run([sys.executable, "-c", SAVE_AND_RESTORE], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert json.loads(completed.stdout.strip().splitlines()[-1]) == {"verl": False, "cpu backend": True}
