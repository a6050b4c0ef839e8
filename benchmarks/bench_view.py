"""Speed of ``verl-ext view`` in headless chromium (Debian's ``chromium``; a figure, not a test).

    python benchmarks/bench_view.py                     # both parts below, traces in a temp dir
    python benchmarks/bench_view.py --part file         # only the self-contained page
    python benchmarks/bench_view.py --dir /tmp/bv       # keep the traces there (reused next time)

1. The page of a trace the size of ``make demo``'s (40 steps × 128 responses × ~9 tokens, one PPO
   epoch of actor and critic update tables): the time ``write_page`` takes, the file's size, and the
   time chromium needs to show it (from the navigation to the first response drawn with the step's
   statistics), the median and the worst of several loads. Goal: < 2 s.
2. The served view of a synthetic 20 M-token trace (10 steps × 512 responses of 2k–6k tokens, one
   PPO epoch of update tables): ``verl-ext view TRACE --port 0`` in its own process, then the time to
   the first response on the page (server started cold: the step is read then), a new response of
   the same step, a response of another step (read cold), and the step's statistics (summary, the
   estimators compared, the check of the step). Goals: first response < 2 s, a new response < 200 ms.

Times are wall-clock on this machine; chromium is driven over the DevTools protocol
(tests/view/chromium.py) and polled every 10 ms, which bounds their resolution.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.view.chromium import Browser  # noqa: E402
from verl_ext import registry  # noqa: E402
from verl_ext.options import TraceOptions  # noqa: E402
from verl_ext.trace.capture import StepCapture  # noqa: E402
from verl_ext.trace.update_files import UpdateCapture  # noqa: E402
from verl_ext.trace.schema import RunRecord  # noqa: E402
from verl_ext.trace.writer import TraceWriter  # noqa: E402

ESTIMATOR = registry.get("mc")
SETTINGS = ESTIMATOR.settings({"gamma": 1.0})


def synthetic_step(step: int, samples: int, min_len: int, max_len: int, vocab: int) -> tuple[StepCapture, list[UpdateCapture]]:
    """One step of an mc run with an outcome score, and its update tables (one epoch, two mini-batches)."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(min_len, max_len + 1, (samples,), generator=g)
    width = int(lengths.max())
    mask = (torch.arange(width) < lengths[:, None]).float()
    scores = torch.zeros(samples, width)
    scores[torch.arange(samples), lengths - 1] = torch.randint(0, 2, (samples,), generator=g).float()
    values = torch.rand(samples, width, generator=g).to(torch.bfloat16).float() * mask
    result = registry.run(ESTIMATOR, scores, values, mask, SETTINGS)
    old = -torch.rand(samples, width, generator=g) * 2 * mask
    floats = {"score": scores, "reward": scores, "value": values, "advantage": result.advantages, "return": result.returns,
              "advantage_raw": result.advantage_raw, "old_log_prob": old, "rollout_log_prob": old + 1e-3 * mask}  # fmt: skip
    prompts = torch.randint(4, vocab, (samples // 4, 64), generator=g).repeat_interleave(4, 0)
    capture = StepCapture(
        step=step, mask=mask, token_id=torch.randint(4, vocab, (samples, width), generator=g),
        uid=[f"s{step}-g{i // 4}" for i in range(samples)], floats=floats, prompts=prompts,
        eos_token_ids=[3], max_response_length=width, whitening=registry.whitening_statistics(result.advantage_raw, mask),
    )  # fmt: skip
    sample, position = (x.numpy().astype(np.int32) for x in torch.nonzero(mask, as_tuple=True))
    n = len(sample)
    shift = (np.random.default_rng(step).random(n, np.float32) - 0.5) * 0.5
    old_valid = old.numpy()[sample, position]
    advantage = result.advantages.numpy()[sample, position]
    ratio = np.exp(shift)
    clip = np.where((advantage < 0) & (ratio < 0.8), "low", np.where((advantage > 0) & (ratio > 1.2), "high", "none")).astype(object)
    half = sample < samples // 2
    where = dict(epoch=0, microbatch=0, rank=0, global_batch_size=samples // 2, dp_size=1)
    actor, critic = [], []
    for minibatch, rows in enumerate((half, ~half)):
        key = {"sample": sample[rows], "token_index": position[rows]}
        part = where | {"minibatch": minibatch, "batch_num_tokens": int(rows.sum())}
        actor.append(part | {"columns": key | {"log_prob": (old_valid + shift)[rows], "old_log_prob": old_valid[rows], "ratio": ratio[rows],
                                               "advantage": advantage[rows], "pg_loss": (-advantage * ratio)[rows], "clip": clip[rows]}})  # fmt: skip
        vpred = values.numpy()[sample, position][rows]
        target = result.returns.numpy()[sample, position][rows]
        critic.append(part | {"columns": key | {"vpred": vpred, "vpred_clipped": vpred, "value": vpred, "return": target,
                                                "vf_loss": (vpred - target) ** 2, "vf_clipped": np.zeros(int(rows.sum()), bool)}})  # fmt: skip
    return capture, [UpdateCapture(step, "actor", actor, {}), UpdateCapture(step, "critic", critic, {})]


def build_trace(directory: Path, steps: int, samples: int, min_len: int, max_len: int, vocab: int) -> None:
    record = RunRecord(
        verl_ext_version="bench", verl_version="0.9.1", trainer="legacy", created_at="",
        algorithm={"adv_estimator": "mc", "gamma": 1.0, "lam": 1.0, "whiten_advantages": True, "norm_adv_by_std_in_grpo": True,
                   "use_kl_in_reward": False, "kl_penalty": "kl", "kl_ctrl": {"type": "fixed", "kl_coef": 0.001}},
        model_path="", tokenizer_path="", rollout_n=4, trace={},
        update={"actor": {"loss_mode": "vanilla", "loss_agg_mode": "token-mean", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0},
                "critic": {"cliprange_value": 0.5, "loss_agg_mode": "token-mean"}},
    )  # fmt: skip
    options = TraceOptions(dir=str(directory))
    with TraceWriter(options, dataclasses.replace(record, trace=options.as_dict())) as writer:
        for step in range(1, steps + 1):
            capture, updates = synthetic_step(step, samples, min_len, max_len, vocab)
            writer.submit(capture)
            for update in updates:
                writer.submit_update(update)
            print(f"  built step {step}/{steps}", flush=True)


def save_tokenizer(path: Path, vocab: int) -> str:
    """A word-level tokenizer of ``vocab`` pieces, some of them CJK (what a page decodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<pad>", "<unk>", "<s>", "</s>"] + [f"{chr(0x4E00 + i)}{i}" if i % 3 == 0 else f"w{i}" for i in range(vocab - 4)]
    backend = Tokenizer(models.WordLevel(vocab={p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(pieces[:4])
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>").save_pretrained(path)
    return str(path)


def trace_in(base: Path, name: str, build) -> Path:
    directory = base / name
    if not (directory / "_run.json").exists():
        started = time.perf_counter()
        build(directory)
        print(f"{name}: written to {directory} in {time.perf_counter() - started:.1f} s")
    return directory


def page_timing(page) -> tuple[float, float]:
    """(ms until the data was there, ms drawing it) of the last view, as the page measured them."""
    data, drawing = page.evaluate("document.body.dataset.timing").split()
    return float(data), float(drawing)


def timed_show(page, url: str, step: int, sample: int, stats: bool) -> float:
    """Seconds from asking for ``url`` to (step, sample) drawn (and, with ``stats``, the step's statistics)."""
    same_document = page.evaluate("location.href").split("#")[0] == url.split("#")[0]
    started = time.perf_counter()
    if same_document:
        page.evaluate(f"delete document.body.dataset.rendered; delete document.body.dataset.stats; location.hash = {url.split('#')[1]!r}")
    else:
        page.send("Page.navigate", {"url": url})
    page.wait_rendered(step, sample, stats=stats, timeout=120)
    return time.perf_counter() - started


def bench_file(base: Path, browser: Browser, loads: int) -> None:
    from verl_ext.view import write_page

    tokenizer = save_tokenizer(base / "tokenizer", 64)
    trace = trace_in(base, "demo_sized", lambda d: build_trace(d, 40, 128, 6, 12, 64))
    started = time.perf_counter()
    out = write_page(trace, base / "demo_sized.html", tokenizer=tokenizer)
    built = time.perf_counter() - started
    size = out.stat().st_size
    from verl_ext.trace.reader import open_trace

    rows = sum(open_trace(str(trace)).record.steps[str(s)].rows for s in range(1, 41))
    times = []
    for _ in range(loads):
        page = browser.page()
        times.append(timed_show(page, f"file://{out}", 40, 0, stats=True))
        page.close()
    print(f"file: 40 steps × 128 responses, {rows:,} token rows with update tables: write_page {built:.2f} s, "
          f"{size / 1e6:.1f} MB ({size / rows:.0f} B/row); shown in chromium in {statistics.median(times):.2f} s "
          f"(median of {loads} loads; worst {max(times):.2f} s; goal < 2 s)")  # fmt: skip
    demo = Path("outputs/demo/trace")
    if (demo / "_run.json").exists():
        tokenizer_dir = next(iter(sorted(Path.home().glob(".cache/verl_ext/cpu_assets/*/model"))), None)
        started = time.perf_counter()
        real = write_page(str(demo), base / "demo.html", tokenizer=str(tokenizer_dir) if tokenizer_dir else None)
        built = time.perf_counter() - started
        times = []
        steps = open_trace(str(demo)).steps
        for _ in range(loads):
            page = browser.page()
            times.append(timed_show(page, f"file://{real}", steps[-1], 0, stats=True))
            page.close()
        print(f"file: make demo's own trace ({demo}): write_page {built:.2f} s, {real.stat().st_size / 1e6:.1f} MB; "
              f"shown in {statistics.median(times):.2f} s (median of {loads}; worst {max(times):.2f} s)")  # fmt: skip


def start_server(trace: Path, tokenizer: str) -> tuple[subprocess.Popen, str]:
    """``verl-ext view TRACE --port 0`` in its own process, and its URL once it listens."""
    server = subprocess.Popen(
        [sys.executable, "-m", "verl_ext.cli", "view", str(trace), "--port", "0", "--tokenizer", tokenizer],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return server, server.stdout.readline().split(" at ", 1)[1].split(" ")[0]


def bench_served(base: Path, browser: Browser, samples_to_try: int, starts: int) -> None:
    tokenizer = save_tokenizer(base / "tokenizer", 64)
    trace = trace_in(base, "served_20m", lambda d: build_trace(d, 10, 512, 2048, 6144, 64))
    from verl_ext.trace.reader import open_trace

    opened = open_trace(str(trace))
    rows = sum(entry.rows for entry in opened.record.steps.values())
    first, new, other, statistics_after, inside = [], [], [], [], []
    for attempt in range(starts):  # each start is a cold server: nothing read yet
        server, url = start_server(trace, tokenizer)
        try:
            page = browser.page()
            first.append(timed_show(page, f"{url}#step=5&sample=0", 5, 0, stats=False))
            if attempt == 0:
                page.wait_rendered(5, 0, stats=True, timeout=300)
                for sample in range(1, samples_to_try + 1):
                    chosen = sample * 37 % 512
                    new.append(timed_show(page, f"{url}#step=5&sample={chosen}", 5, chosen, stats=False))
                    inside.append(page_timing(page))
                other.append(timed_show(page, f"{url}#step=9&sample=3", 9, 3, stats=False))
                started = time.perf_counter()
                page.wait_rendered(9, 3, stats=True, timeout=300)
                statistics_after.append(time.perf_counter() - started + other[-1])
                tokens = page.evaluate("document.querySelectorAll('#response .tok').length")
            page.close()
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(f"served: {rows / 1e6:.1f} M token rows in {len(opened.steps)} steps (~{rows / len(opened.steps) / 1e6:.1f} M per step, "
          f"responses of 2k-6k tokens), with update tables; first response from a cold server: median {statistics.median(first):.2f} s, "
          f"worst {max(first):.2f} s over {len(first)} starts (goal < 2 s); a new response of the same step: median "
          f"{statistics.median(new) * 1000:.0f} ms, worst {max(new) * 1000:.0f} ms over {len(new)} (goal < 200 ms; inside the page: "
          f"{statistics.median(d for d, _ in inside):.0f} ms for the data, {statistics.median(w for _, w in inside):.0f} ms drawing); a response "
          f"of another step (read cold) {other[0]:.2f} s; that step's statistics (summary, estimators, check) "
          f"{statistics_after[0]:.1f} s after asking; last response shown: {tokens} tokens")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("file", "served", "both"), default="both")
    parser.add_argument("--dir", type=Path, help="keep the traces here (reused when present)")
    parser.add_argument("--loads", type=int, default=5, help="page loads of the file measured")
    parser.add_argument("--samples", type=int, default=10, help="new responses measured in the served view")
    parser.add_argument("--starts", type=int, default=3, help="cold starts of the server measured")
    args = parser.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench_view_"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        with Browser() as browser:
            print(f"{browser.version}, {os.cpu_count()} CPU cores")
            if args.part in ("file", "both"):
                bench_file(base, browser, args.loads)
            if args.part in ("served", "both"):
                bench_served(base, browser, args.samples, args.starts)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
