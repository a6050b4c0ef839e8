"""What every task's assets are built with: the cache they are published in, a character-level
tokenizer, the tiny ``llama`` and the supervised fine-tune of its warm start.

A task (:mod:`verl_ext.tasks.arith`, :mod:`verl_ext.tasks.tool`) brings its own prompts, characters,
chat template and training examples; these pieces are the same for all of them. Moving code here
changes no asset: a cache directory is named after the hash of the task's spec
(``AssetSpec.key()``, its field values only), never after the code that builds it.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import random
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from verl_ext.torch_threads import one_torch_thread

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
#: Renders ``<|role|>content`` per message; an assistant turn ends with EOS.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}" + EOS + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# --------------------------------------------------------------------------- the cache


def default_cache_dir() -> Path:
    """``$VERL_EXT_CPU_ASSETS`` if set, else ``~/.cache/verl_ext/cpu_assets``."""
    return Path(os.environ.get("VERL_EXT_CPU_ASSETS") or Path.home() / ".cache" / "verl_ext" / "cpu_assets")


def cached_build(cache_dir: str | os.PathLike | None, spec, build: Callable[[Path], None]) -> Path:
    """The directory of ``spec``'s assets under ``cache_dir`` (default :func:`default_cache_dir`):
    ``build(staging)`` writes them once, into a staging directory published by an atomic rename
    with ``spec.json`` (the dataclass ``spec``, whose ``key()`` names the directory) beside them.
    A second caller waits for a build in progress (a lock file beside the cache) and then reads it."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / spec.key()
    if not (target / "spec.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f".{spec.key()}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a second caller waits for the first build instead of building too
            if not (target / "spec.json").exists():
                _publish(target, spec, build)
    return target


def _publish(target: Path, spec, build: Callable[[Path], None]) -> None:
    """Build into a staging directory beside ``target``, then publish it with an atomic rename."""
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the published assets are plain files
    try:
        build(staging)
        (staging / "spec.json").write_text(json.dumps(asdict(spec), indent=2))
        try:
            staging.rename(target)
        except OSError:
            if not (target / "spec.json").exists():  # not another builder (without the lock) winning the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --------------------------------------------------------------------------- the tokenizer and the model


def character_tokenizer(
    characters: str, roles: tuple[str, ...] = ROLE_TOKENS, plain_tokens: tuple[str, ...] = (), chat_template: str = CHAT_TEMPLATE
):
    """A character-level tokenizer: the special tokens and ``roles``, then one token per character of
    ``characters``, then ``plain_tokens``: multi-character tokens that are not special, so that verl's
    reward, which decodes without special tokens, still sees them (a tool's ``<tool_response>``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, UNK, BOS, EOS, *roles]
    vocab = {token: index for index, token in enumerate(specials + list(characters))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()  # join characters back without separators
    backend.add_special_tokens(specials)
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in plain_tokens])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token=PAD, unk_token=UNK, bos_token=BOS, eos_token=EOS
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def tiny_llama(tokenizer, spec):
    """A ``llama`` initialised at random (seeded by ``spec.seed``) of ``spec``'s hidden size, layers and
    heads, for ``tokenizer``'s vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

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
    return LlamaForCausalLM(config)


# --------------------------------------------------------------------------- the supervised fine-tune


def fine_tune(model, pad_id: int, batch, settings, seed: int) -> float:
    """Fine-tune ``model`` in place for ``settings.steps`` steps on ``batch(rng)`` (a list of rows
    ``(prompt_ids, response_ids)`` or ``(prompt_ids, response_ids, loss_mask)``); return the last loss.

    Loss: mean negative log-likelihood of the response tokens with loss (all of them when a row has
    no ``loss_mask``). Adam, linear warm-up over ``settings.warmup_steps`` then cosine decay to 0.1
    of ``settings.lr``, gradient norm clipped at 1.
    """
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    model.train()
    loss = torch.tensor(float("nan"))
    with one_torch_thread():
        for step in range(settings.steps):
            input_ids, attention_mask, response_mask = left_padded(batch(rng), pad_id)
            logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
            target = response_mask[:, 1:]
            loss = -(logp * target).sum() / target.sum()
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * _schedule(step, settings)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    model.eval()
    return float(loss.detach())


def _schedule(step: int, settings) -> float:
    warmup = min(1.0, (step + 1) / settings.warmup_steps)
    return warmup * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / settings.steps)))


def left_padded(rows: list[tuple], pad_id: int):
    """(input_ids, attention_mask, response_mask) of prompt+response rows, left-padded as verl does.

    A row is ``(prompt_ids, response_ids)``, or ``(prompt_ids, response_ids, response_mask)`` when
    some response tokens are not the model's (a tool's answer: 0)."""
    import torch

    width = max(len(row[0]) + len(row[1]) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    response_mask = torch.zeros((len(rows), width))
    for index, (prompt, response, *mask) in enumerate(rows):
        start = width - len(prompt) - len(response)
        input_ids[index, start:] = torch.tensor(prompt + response)
        attention_mask[index, start:] = 1
        if response:
            response_mask[index, width - len(response) :] = torch.tensor(mask[0] if mask else [1.0] * len(response))
    return input_ids, attention_mask, response_mask


def position_ids(attention_mask):
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)
