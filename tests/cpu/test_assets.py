"""The tiny assets: built locally, cached, and what verl's dataset and our reward expect."""

from __future__ import annotations

import pandas as pd
import pytest
from transformers import AutoConfig, AutoTokenizer

from verl_ext.cpu.assets import CHARACTERS, AssetSpec, arithmetic_problems, build_assets

SEED_PROMPT, SEED_RESPONSE = "请问1+1=2？", "是的，等于2！"


@pytest.fixture(scope="module")
def tokenizer(assets):
    return AutoTokenizer.from_pretrained(assets.model_dir)


def test_build_is_idempotent(assets, assets_dir):
    again = build_assets(assets_dir)
    assert again == assets
    weights = "model.safetensors"
    assert (assets.model_dir / weights).stat().st_mtime == (again.model_dir / weights).stat().st_mtime
    assert not [p for p in assets_dir.iterdir() if p.name.startswith(".building-")]


def test_a_different_spec_gets_its_own_directory(assets_dir):
    assert AssetSpec(seed=1).key() != AssetSpec().key()


@pytest.mark.parametrize("text", [SEED_PROMPT, SEED_RESPONSE, "12+34=46\n", CHARACTERS])
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


def test_model_is_a_tiny_llama(assets, tokenizer):
    config = AutoConfig.from_pretrained(assets.model_dir)
    assert config.model_type == "llama"  # transformers 5 forces Qwen2Tokenizer for qwen2
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id


def test_prompts_follow_verls_dataset_schema(assets):
    train, val = pd.read_parquet(assets.train_file), pd.read_parquet(assets.val_file)
    for frame in (train, val):
        assert {"data_source", "prompt", "reward_model", "extra_info"} <= set(frame.columns)
        row = frame.iloc[0]
        (message,) = row["prompt"]
        assert message["role"] == "user"
        a, b = message["content"].rstrip("=").split("+")
        assert row["reward_model"]["ground_truth"] == str(int(a) + int(b))
        assert list(frame["extra_info"].map(lambda info: info["index"])) == list(range(len(frame)))
    questions = lambda frame: {m[0]["content"] for m in frame["prompt"]}  # noqa: E731
    assert not questions(train) & questions(val), "validation problems must be held out"
    assert len(train) + len(val) == len(set(arithmetic_problems(AssetSpec())[0] + arithmetic_problems(AssetSpec())[1]))
