"""Synthetic traces for the browser tests, written with the real TraceWriter, and the reading of the
numbers back out of a rendered page (the expected values come from the Parquet files themselves).

The tokenizer is a word-level one whose pieces include markup (``<script>…``, an ``<img onerror>``),
a double quote, an ampersand entity, a space and CJK text: the page must show each as text.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from tests.inspect.inspect_helpers import algorithm, by_definition, nudge, random_batch
from verl_ext import registry
from verl_ext.options import TraceOptions
from verl_ext.trace.capture import StepCapture
from verl_ext.trace.update_files import UpdateCapture
from verl_ext.trace.schema import RunRecord, prompt_file, token_file, update_file
from verl_ext.trace.writer import TraceWriter

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
EOS = SPECIALS.index("</s>")
SCRIPT = "<script>alert(1)</script>"
IMG = '<img src=x onerror="window.__pwned=1">'
#: ids 4 … 21; random_batch draws response and prompt ids from 7 … 19
PIECES = ["x", "y", "z", SCRIPT, '"', "等于", "，", "是", "的", IMG, "&amp;", "a b", "2", "！", "</div>", "w", "v", "u"]
#: What the page shows for a piece (the inspection's convention: a space as ␣).
SHOWN = {piece: piece.replace(" ", "␣") for piece in PIECES} | {special: special for special in SPECIALS}
VOCAB = [*SPECIALS, *PIECES]
GAMMA, LAM, BETA = 1.0, 0.95, 0.1
B, T = 8, 12
#: Where a NaN value is planted in the data trace: (step, sample, token_index).
NAN_AT = (2, 5, 0)
#: The token table's float columns filled in these traces.
FLOATS = ("score", "reward", "value", "return", "advantage", "advantage_raw", "kl", "old_log_prob", "ref_log_prob", "rollout_log_prob")


def save_piece_tokenizer(path: Path) -> str:
    """A word-level Hugging Face tokenizer whose tokens are VOCAB (decoding joins pieces as they are)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={token: i for i, token in enumerate(VOCAB)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")
    tokenizer.save_pretrained(path)
    return str(path)


def _batch(step: int, planted: bool):
    batch = random_batch(step, B=B, T=T, kl_coef=BETA)
    g = torch.Generator().manual_seed(100 + step)
    lengths = (batch.mask * (torch.arange(T) + 1)).argmax(dim=1)  # last valid position
    for b in range(2, B, 2):  # every other response from the third ends with EOS (so it is not truncated)
        batch.responses[b, lengths[b]] = EOS
    # every token's text in the page must equal its piece: plant the markup pieces in every response
    batch.responses[:, 0] = VOCAB.index(SCRIPT)
    batch.responses[1::2, 1] = VOCAB.index('"')
    batch.responses[::3, 1] = VOCAB.index(IMG)
    # one prompt per group of two; the same prompts at every step (verl gives new uids each step)
    prompts = torch.randint(7, 20, (B // 2, 5), generator=torch.Generator().manual_seed(7)).repeat_interleave(2, 0)
    prompts[:, 2] = VOCAB.index("等于")
    batch = replace(batch, prompts=prompts)
    batch = by_definition(batch, "gae_ext", GAMMA, LAM)
    old = -torch.rand(B, T, generator=g) * 3
    extra = {
        "old_log_prob": old,
        "ref_log_prob": old - torch.rand(B, T, generator=g) * 0.1,
        "rollout_log_prob": old + (torch.rand(B, T, generator=g) - 0.5) * 1e-3,
    }
    if planted and step == NAN_AT[0]:
        batch.values[NAN_AT[1], NAN_AT[2]] = float("nan")
    return batch, extra


def _updates(step: int, batch, extra: dict) -> list[UpdateCapture]:
    """Two PPO epochs, one mini-batch per half of the responses; ratios spread so that some tokens clip."""
    g = torch.Generator().manual_seed(200 + step)
    actor, critic = [], []
    for epoch in (0, 1):
        for minibatch, samples in enumerate((range(0, B // 2), range(B // 2, B))):
            for sample in samples:
                index = torch.nonzero(batch.mask[sample]).flatten()
                n = len(index)
                old = extra["old_log_prob"][sample, index]
                spread = 0.0 if (epoch, minibatch) == (0, 0) else 1.2 if sample % 3 == 0 else 0.1  # only some responses clip
                shift = (torch.rand(n, generator=g) - 0.5) * spread
                log_prob = old + shift
                ratio = torch.exp(log_prob - old)
                advantage = batch.advantages[sample, index]
                # vanilla PPO's term with ε = 0.2 (no dual clip reached: ratios stay below 3)
                term = torch.maximum(-advantage * ratio, -advantage * ratio.clamp(0.8, 1.2))
                clip = np.where((advantage < 0) & (ratio < 0.8), "low", np.where((advantage > 0) & (ratio > 1.2), "high", "none"))
                where = {"epoch": epoch, "minibatch": minibatch, "microbatch": 0, "rank": 0, "batch_num_tokens": n,
                         "global_batch_size": B // 2, "dp_size": 1}  # fmt: skip
                key = {"sample": np.full(n, sample, np.int32), "token_index": index.numpy().astype(np.int32)}
                actor.append(where | {"columns": key | {
                    "log_prob": log_prob.numpy(), "old_log_prob": old.numpy(), "ratio": ratio.numpy(),
                    "advantage": advantage.numpy(), "pg_loss": term.numpy(), "clip": clip.astype(object),
                    "entropy": torch.rand(n, generator=g).numpy() * 2,
                }})  # fmt: skip
                vpred = batch.values[sample, index] + (torch.rand(n, generator=g) - 0.5) * 0.2
                target = batch.returns[sample, index]
                critic.append(where | {"columns": key | {
                    "vpred": vpred.numpy(), "vpred_clipped": vpred.numpy(), "value": batch.values[sample, index].numpy(),
                    "return": target.numpy(), "vf_loss": ((vpred - target) ** 2).numpy(), "vf_clipped": np.zeros(n, bool),
                }})  # fmt: skip
    return [UpdateCapture(step, "actor", actor, {}), UpdateCapture(step, "critic", critic, {})]


def write_view_trace(directory: Path, tokenizer: str, steps=(1, 2, 3), updates: bool = True, planted: bool = True,
                     nudged: tuple[int, int, int] | None = None) -> str:
    """A GAE(γ=1, λ=0.95) trace with KL in the reward, groups of two responses per prompt (the same
    prompts at every step), EOS on some responses (the first is truncated), markup pieces in every
    response, a NaN value at NAN_AT (``planted``), and two PPO epochs of update tables (``updates``).
    ``nudged``: (step, sample, token) whose return is changed by 1% (the check fails there)."""  # fmt: skip
    options = TraceOptions(dir=str(directory))
    record = RunRecord(
        verl_ext_version="test", verl_version="0.9.1", trainer="legacy", created_at="2026-01-01T00:00:00+00:00",
        algorithm=algorithm("gae_ext", gamma=GAMMA, lam=LAM, kl="kl"), model_path=tokenizer, tokenizer_path=tokenizer,
        rollout_n=2, trace=options.as_dict(),
        update={"actor": {"loss_mode": "vanilla", "loss_agg_mode": "token-mean", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0},
                "critic": {"cliprange_value": 0.5, "loss_agg_mode": "token-mean"}} if updates else {},
    )  # fmt: skip
    with TraceWriter(options, record) as writer:
        for step in steps:
            batch, extra = _batch(step, planted)
            if nudged is not None and nudged[0] == step:
                nudge(batch.returns, nudged[1], nudged[2])
            floats = dict(score=batch.scores, reward=batch.rewards, value=batch.values, advantage=batch.advantages,
                          advantage_raw=batch.advantage_raw, kl=batch.kl, **extra)  # fmt: skip
            floats["return"] = batch.returns
            writer.submit(StepCapture(
                step=step, mask=batch.mask, token_id=batch.responses, uid=[f"s{step}-g{i // 2}" for i in range(B)],
                floats=floats, prompts=batch.prompts, prompt_mask=torch.ones_like(batch.prompts, dtype=torch.bool),
                kl_coef=BETA, eos_token_ids=[EOS], max_response_length=T,
                whitening=registry.whitening_statistics(batch.advantage_raw, batch.mask),
            ))  # fmt: skip
            if updates:
                for update in _updates(step, batch, extra):
                    writer.submit_update(update)
    return str(directory)


# ---------------------------------------------------------------- expected values, from the Parquet files


def parquet_tokens(trace: str, step: int, sample: int) -> dict:
    """The rows of (step, sample) as Python values, read with pyarrow from the step's file."""
    table = pq.read_table(f"{trace}/{token_file(step)}").to_pylist()
    return [row for row in table if row["sample"] == sample]


def parquet_updates(trace: str, kind: str, step: int, sample: int) -> list[dict]:
    path = Path(trace) / update_file(kind, step)
    if not path.exists():
        return []
    return [row for row in pq.read_table(path).to_pylist() if row["sample"] == sample]


def parquet_prompts(trace: str, step: int) -> list[dict]:
    return pq.read_table(f"{trace}/{prompt_file(step)}").to_pylist()


def same_number(shown: str | None, expected) -> bool:
    """A number in the DOM equals the trace's float32 (the float32 as a double, exactly; NaN = NaN)."""
    if expected is None:
        return shown is None
    if shown is None:
        return False
    value = float(shown)
    expected = float(np.float32(expected)) if isinstance(expected, float) else expected
    return (math.isnan(value) and math.isnan(expected)) or value == expected


UPDATE_SHOWN = {"actor": ("minibatch", "log_prob", "ratio", "pg_loss", "clip", "entropy"), "critic": ("vpred", "vpred_clipped", "vf_loss", "vf_clipped")}


def compare_tokens(tokens: list[dict], trace: str, step: int, sample: int) -> list[str]:
    """Every difference between the token spans of a page (their text and attributes) and the trace's
    rows of (step, sample) and its update rows; [] when they agree."""
    rows = parquet_tokens(trace, step, sample)
    problems = []
    if len(tokens) != len(rows):
        return [f"{len(tokens)} tokens on the page, {len(rows)} rows in the trace"]
    updates = {kind: parquet_updates(trace, kind, step, sample) for kind in UPDATE_SHOWN}
    for span, row in zip(tokens, rows):
        attrs, t = span["attrs"], row["token_index"]
        numbers = numbers_of(span)
        expected_text = SHOWN[VOCAB[row["token_id"]]]
        if span["text"] != expected_text:
            problems.append(f"token {t}: text {span['text']!r}, trace {expected_text!r}")
        for name, value in (("data-t", t), ("data-id", row["token_id"]), ("data-mask", "1" if row["mask"] else "0")):
            if attrs.get(name) != str(value):
                problems.append(f"token {t}: {name} = {attrs.get(name)!r}, trace {value!r}")
        for name in FLOATS:
            if not same_number(numbers.get(name), row[name]):
                problems.append(f"token {t}: {name} = {numbers.get(name)!r}, trace {row[name]!r}")
        log_ratio = float(np.float32(row["old_log_prob"])) - float(np.float32(row["rollout_log_prob"]))  # ℓ_t
        if not same_number(numbers.get("log_ratio"), log_ratio):
            problems.append(f"token {t}: log_ratio = {numbers.get('log_ratio')!r}, trace {log_ratio!r}")
        expected_names = set()
        for kind, names in UPDATE_SHOWN.items():
            for update in (u for u in updates[kind] if u["token_index"] == t):
                for name in names:
                    key = f"e{update['epoch']}.{name}"
                    expected_names.add(key)
                    shown, value = numbers.get(key), update[name]
                    if name == "clip":
                        ok = shown == value
                    elif name == "vf_clipped":
                        ok = shown == ("1" if value else "0")
                    else:
                        ok = same_number(shown, value)
                    if not ok:
                        problems.append(f"token {t}: epoch {update['epoch']} {name} = {shown!r}, trace {value!r}")
        stray = sorted(n for n in numbers if re.fullmatch(r"e\d+\..+", n) and n not in expected_names)
        if stray:
            problems.append(f"token {t}: update attributes without an update row: {stray}")
    return problems


def numbers_of(span: dict) -> dict[str, str]:
    """The numbers of a token span: its ``data-q="name=value name=value …"`` as a dict of strings."""
    return dict(part.split("=", 1) for part in span["attrs"].get("data-q", "").split(" ") if part)


class _Tokens(HTMLParser):
    """The ``<span class="tok">`` elements inside ``#response`` of a serialised DOM."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tokens: list[dict] = []
        self.depth = 0  # inside #response
        self.current: dict | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if self.depth:
            self.depth += 1
            if tag == "span" and "tok" in (attrs.get("class") or "").split():
                self.current = {"attrs": attrs, "text": ""}
        elif attrs.get("id") == "response":
            self.depth = 1

    def handle_endtag(self, tag):
        if self.depth:
            self.depth -= 1
            if self.current is not None and tag == "span":
                self.tokens.append(self.current)
                self.current = None

    def handle_data(self, data):
        if self.current is not None:
            self.current["text"] += data


def tokens_in_dom(html: str) -> list[dict]:
    parser = _Tokens()
    parser.feed(html)
    return parser.tokens


#: The token spans of the page, read in the browser (for a page driven over the DevTools protocol).
TOKENS_JS = """[...document.querySelectorAll('#response .tok')].map(s => ({
  text: s.textContent, attrs: Object.fromEntries(s.getAttributeNames().map(n => [n, s.getAttribute(n)]))}))"""
