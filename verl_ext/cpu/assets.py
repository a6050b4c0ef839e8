"""Tiny, real training assets built at run time: no model or dataset is ever downloaded.

``build_assets()`` writes, once per spec, into a cache directory:

* ``model/``: a randomly initialised ``llama`` model (hidden 64, 2 layers, fixed seed) saved with
  ``save_pretrained``, next to a character-level tokenizer built with the ``tokenizers`` library.
  ``llama`` and not ``qwen2``: transformers 5 forces ``Qwen2Tokenizer`` for ``model_type: qwen2``,
  which breaks a character-level vocabulary; a ``llama`` config round-trips exactly.
* ``train.parquet`` / ``val.parquet``: "a+b=" prompts in verl's RLHFDataset schema (chat-message
  ``prompt``, ``reward_model.ground_truth``, ``extra_info.index``); validation problems are held out.
* the reward function is :mod:`verl_ext.cpu.reward` (a source file verl loads by path).

The build is idempotent and safe to race: a finished build is a directory named after the hash of
its spec, published with an atomic rename.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from verl_ext.cpu import reward

#: Bump when the layout or content of the assets changes, so old caches are not reused.
ASSETS_FORMAT = 1

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
#: What the arithmetic task and the seed dialogue ("请问1+1=2？" / "是的，等于2！") need.
CHARACTERS = "0123456789+-*/=?()., \n" + "请问是的，等于！？"
#: Renders ``<|role|>content`` per message; an assistant turn ends with EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}" + EOS + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DATA_SOURCE = "verl_ext/arithmetic"


@dataclass(frozen=True)
class AssetSpec:
    """Everything that determines the content of the assets (hashed into the cache key)."""

    seed: int = 0
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    max_operand: int = 9
    val_fraction: float = 0.2
    format: int = ASSETS_FORMAT

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class CpuAssets:
    """Paths of one built asset set."""

    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path
    reward_file: Path
    reward_name: str = "compute_score"


def default_cache_dir() -> Path:
    """``$VERL_EXT_CPU_ASSETS`` if set, else ``~/.cache/verl_ext/cpu_assets``."""
    return Path(os.environ.get("VERL_EXT_CPU_ASSETS") or Path.home() / ".cache" / "verl_ext" / "cpu_assets")


def build_assets(cache_dir: str | os.PathLike | None = None, spec: AssetSpec = AssetSpec()) -> CpuAssets:
    """Build the assets for ``spec`` under ``cache_dir`` unless they already exist; return their paths."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / spec.key()
    if not (target / "spec.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        staging.chmod(0o755)  # mkdtemp makes it private; the published assets are plain files
        try:
            _write_model_and_tokenizer(staging / "model", spec)
            _write_prompts(staging, spec)
            (staging / "spec.json").write_text(json.dumps(asdict(spec), indent=2))
            try:
                staging.rename(target)
            except OSError:
                if not (target / "spec.json").exists():  # not a concurrent builder winning the race
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return _paths(target)


def _paths(target: Path) -> CpuAssets:
    return CpuAssets(
        root=target,
        model_dir=target / "model",
        train_file=target / "train.parquet",
        val_file=target / "val.parquet",
        reward_file=Path(reward.__file__).resolve(),
    )


def build_tokenizer():
    """The character-level tokenizer: every character in ``CHARACTERS`` is one token."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, UNK, BOS, EOS, *ROLE_TOKENS]
    vocab = {token: index for index, token in enumerate(specials + list(CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()  # join characters back without separators
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, unk_token=UNK, bos_token=BOS, eos_token=EOS
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _write_model_and_tokenizer(model_dir: Path, spec: AssetSpec) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=2 * spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def arithmetic_problems(spec: AssetSpec) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All ``a+b`` with operands in [0, max_operand], shuffled with the spec's seed and split train/val."""
    problems = [(a, b) for a in range(spec.max_operand + 1) for b in range(spec.max_operand + 1)]
    random.Random(spec.seed).shuffle(problems)
    n_val = max(1, round(len(problems) * spec.val_fraction))
    return problems[n_val:], problems[:n_val]


def prompt_row(a: int, b: int, split: str, index: int) -> dict:
    """One row in verl's RLHFDataset schema."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "a": a, "b": b},
    }


def _write_prompts(directory: Path, spec: AssetSpec) -> None:
    import pandas as pd

    train, val = arithmetic_problems(spec)
    for split, problems in (("train", train), ("val", val)):
        rows = [prompt_row(a, b, split, index) for index, (a, b) in enumerate(problems)]
        pd.DataFrame(rows).to_parquet(directory / f"{split}.parquet")
