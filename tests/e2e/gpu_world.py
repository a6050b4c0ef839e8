"""What a run in verl's GPU settings (issue 31) must show, for the Ray tests that make one.

A GPU run computes in bf16 (verl's FSDP default with ``mixed_precision`` unset), packs sequences
(``use_remove_padding``), adds the entropy to the loss and sizes micro-batches by tokens
(``use_dynamic_bsz``). :data:`GPU_WORLD_OVERRIDES` (with ``PRECISION=bf16`` for
``recipes/cpu_demo.sh``) turns a CPU run into one; :func:`assert_gpu_world` checks, from the run's
own outputs, that it ran so and that the trace read what the trainer used.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import yaml

#: Tokens per micro-batch: above the longest sequence (16 + 16 tokens), below a mini-batch's (4 of
#: about 25), so that dynamic batch size splits every mini-batch (the update tables' micro-batches).
MAX_TOKENS = 64
GPU_WORLD_OVERRIDES = [
    "actor_rollout_ref.model.use_remove_padding=True",
    "critic.model.use_remove_padding=True",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "critic.use_dynamic_bsz=True",
    f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={MAX_TOKENS}",
    f"critic.ppo_max_token_len_per_gpu={MAX_TOKENS}",
    # the V1 trainer trains the critic with its inference budget (verl trainer_base.py:267-268)
    f"+critic.ppo_infer_max_token_len_per_gpu={MAX_TOKENS}",  # not in verl's yaml, in its CriticConfig
    # two mini-batches: the second sees a moved policy, so ratios leave 1 (in bf16 they are rounded)
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "critic.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=4",
]


def composed_config(output_dir: Path) -> dict:
    """The config the trainer ran with, as hydra saved it under the recipe's ``outputs/``."""
    (path,) = sorted(Path(output_dir, "outputs").glob("*/*/.hydra/config.yaml"))
    return yaml.safe_load(path.read_text())


def bf16_exact(values: np.ndarray) -> bool:
    """Every value is a bf16 number (float32 with its low 16 mantissa bits zero): read, not recomputed."""
    return bool((np.ascontiguousarray(values, np.float32).view(np.uint32) & 0xFFFF == 0).all())


def column(trace: Path, table: str, name: str) -> np.ndarray:
    values = ds.dataset(trace / table, format="parquet").to_table(columns=[name])[name]
    values = np.asarray(values.to_numpy(zero_copy_only=False), np.float32)
    return values[~np.isnan(values)]


def assert_gpu_world(output_dir: Path, trace: Path, critic: bool = True) -> None:
    """The run at ``output_dir`` (traced to ``trace``) ran in bf16 with packed sequences, entropy in
    the loss and dynamic batch size, and its trace holds the bf16 numbers the trainer used."""
    config = composed_config(output_dir)
    actor = config["actor_rollout_ref"]["actor"]
    engines = [actor["fsdp_config"], config["actor_rollout_ref"]["ref"]["fsdp_config"]]
    engines += [config["critic"]["fsdp"]] if critic else []
    # unset: verl's FSDPEngine computes in bf16 with autocast, reduces in fp32 (transformer_impl.py:393-403)
    assert all(engine.get("mixed_precision") is None for engine in engines), engines
    assert config["actor_rollout_ref"]["model"]["use_remove_padding"] is True
    assert not critic or config["critic"]["model"]["use_remove_padding"] is True
    assert actor["use_dynamic_bsz"] is True and actor["entropy_coeff"] > 0
    assert not critic or config["critic"]["use_dynamic_bsz"] is True

    record = json.loads((trace / "_run.json").read_text())["update"]  # what check's tolerances follow
    assert [record[kind]["dtype"] for kind in ("actor", "critic")[: 1 + critic]] == ["bf16"] * (1 + critic), record

    read = {"_actor_update": ["log_prob", "old_log_prob", "entropy"]}
    read |= {"_critic_update": ["vpred", "value"]} if critic else {}
    for table, names in read.items():
        for name in names:
            values = column(trace, table, name)
            assert len(values) and bf16_exact(values), f"{table}.{name}: not the bf16 numbers the trainer used"
        split = ds.dataset(trace / table, format="parquet").to_table(columns=["microbatch"])["microbatch"]
        assert max(split.to_pylist()) >= 1, f"{table}: dynamic batch size did not split a mini-batch"
