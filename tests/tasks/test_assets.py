"""The tiny assets: built locally, cached, and what verl's dataset and our reward expect."""

from __future__ import annotations

import concurrent.futures
import fcntl
import time

import pandas as pd
import pytest
from transformers import AutoConfig, AutoTokenizer

from verl_ext.tasks.arith.assets import CHARACTERS, AssetSpec, build_assets, task_problems, token_id

SEED_PROMPT, SEED_RESPONSE = "请问1+1=2？", "是的，等于2！"


@pytest.fixture(scope="module")
def tokenizer(assets):
    return AutoTokenizer.from_pretrained(assets.model_dir)


def test_build_is_idempotent(assets, assets_dir):
    again = build_assets(assets_dir)
    assert again == assets
    weights = "model.safetensors"
    assert (assets.model_dir / weights).stat().st_mtime == (again.model_dir / weights).stat().st_mtime
    # the pretrained critic is cached with the rest: not trained again
    assert (assets.critic_dir / weights).stat().st_mtime == (again.critic_dir / weights).stat().st_mtime
    assert assets.value_pretraining_report.stat().st_mtime == again.value_pretraining_report.stat().st_mtime
    assert not [p for p in assets_dir.iterdir() if p.name.startswith(".building-")]


def test_a_second_caller_waits_for_the_build_in_progress_and_reuses_it(tmp_path):
    """While another process holds the build lock, build_assets waits; once that build is published
    it returns the published directory without building (a build would take a minute and leave a
    staging directory)."""
    spec = AssetSpec(seed=7)
    target = tmp_path / spec.key()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with open(tmp_path / f".{spec.key()}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the other builder
            waiting = pool.submit(build_assets, tmp_path, spec)
            time.sleep(0.5)
            assert not waiting.done()
            target.mkdir()
            (target / "spec.json").write_text("{}")  # the other builder publishes
        assert waiting.result(timeout=10).root == target
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([spec.key(), f".{spec.key()}.lock"])


def test_a_different_spec_gets_its_own_directory(assets_dir):
    assert AssetSpec(seed=1).key() != AssetSpec().key()


@pytest.mark.parametrize("text", [SEED_PROMPT, SEED_RESPONSE, "等于12，不是！", "12+34=46\n", CHARACTERS])
def test_tokenizer_round_trips_exactly(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_seed_dialogue_through_the_chat_template(tokenizer):
    messages = [{"role": "user", "content": SEED_PROMPT}, {"role": "assistant", "content": SEED_RESPONSE}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == f"<|user|>{SEED_PROMPT}<|assistant|>{SEED_RESPONSE}</s>"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == f"<|user|>{SEED_PROMPT}<|assistant|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == SEED_PROMPT + SEED_RESPONSE


def test_special_tokens(tokenizer):
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id is not None
    assert len({tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id}) == 3


def test_token_ids_without_loading_the_tokenizer(tokenizer):
    assert [token_id(ch) for ch in CHARACTERS] == tokenizer.convert_tokens_to_ids(list(CHARACTERS))


def test_model_is_a_tiny_llama(assets, tokenizer):
    config = AutoConfig.from_pretrained(assets.model_dir)
    assert config.model_type == "llama"  # transformers 5 forces Qwen2Tokenizer for qwen2
    assert (config.hidden_size, config.num_hidden_layers) == (128, 2)
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id


def test_prompts_follow_verls_dataset_schema(assets):
    import re

    train, val = pd.read_parquet(assets.train_file), pd.read_parquet(assets.val_file)
    for frame in (train, val):
        assert {"data_source", "prompt", "reward_model", "extra_info"} <= set(frame.columns)
        for _, row in frame.iterrows():
            (message,) = row["prompt"]
            assert message["role"] == "user"
            a, b, c = map(int, re.fullmatch(r"请问(\d)\+(\d)=(\d+)？", message["content"]).groups())
            verdict = "是的" if a + b == c else "不是"
            assert row["reward_model"]["ground_truth"] == f"等于{a + b}，{verdict}！"
        assert list(frame["extra_info"].map(lambda info: info["index"])) == list(range(len(frame)))
    questions = lambda frame: {m[0]["content"] for m in frame["prompt"]}  # noqa: E731
    assert not questions(train) & questions(val), "validation problems must be held out"
    assert len(val) == AssetSpec().val_problems and len(train) == AssetSpec().train_rows
    right = train["reward_model"].map(lambda r: r["ground_truth"].endswith("是的！"))
    assert right.mean() == 0.5  # right and wrong prompts alternate
    assert [p.question() for p in task_problems(AssetSpec())[1]] == [m[0]["content"] for m in val["prompt"]]


def test_value_pretraining_report(assets):
    """The pretrained critic sees the outcome once the verdict is written, and not before it."""
    import json

    report = json.loads(assets.value_pretraining_report.read_text())
    fit = report["held_out_fit"]
    assert fit["ev_after_verdict"] >= 0.5, fit
    assert fit["ev_before_verdict"] < fit["ev_after_verdict"]
    per_epoch = report["held_out_fit_per_epoch"]
    assert fit == per_epoch[report["best_epoch"]]  # the weights kept are those of the best epoch
    # best: no later epoch beat it by min_gain (index 0: the fit before any update)
    assert fit["ev_after_verdict"] >= max(f["ev_after_verdict"] for f in per_epoch) - report["settings"]["min_gain"]
    assert per_epoch[0]["ev_after_verdict"] < 0.5  # epoch 0 is the untrained head: the fit is learned
    assert report["responses"] == AssetSpec().train_rows  # one sampled answer per training row
    assert report["updates"] > 0 and report["seconds"] > 0
    assert 0.05 < report["wrong_verdicts"] < 0.95  # wrong verdicts to learn the outcome from


def test_the_critic_is_verls_value_model_trained_from_the_warm_start(assets):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(assets.critic_dir, dtype=torch.float32)
    warm = AutoModelForCausalLM.from_pretrained(assets.model_dir, dtype=torch.float32)
    assert critic.config.num_labels == 1
    assert isinstance(critic.score, torch.nn.Linear) and critic.score.out_features == 1
    body, warm_body = critic.model.state_dict(), warm.model.state_dict()
    assert body.keys() == warm_body.keys()
    for name, tensor in body.items():
        assert tensor.shape == warm_body[name].shape, name
        assert not torch.equal(tensor, warm_body[name]), f"{name} was not trained"
