"""The bytes of update tables that reach the driver per traced step, by number of data-parallel ranks.

    .venv/bin/python benchmarks/bench_update_payload.py [--ranks 1 2 4 8] [--samples 64] [--response 256]

One trainer batch (``--samples`` responses of 1 to ``--response`` tokens, the same at every rank count)
is split over N data-parallel ranks as verl's dispatch splits it; each rank, a process of one gloo
group, runs verl's own ``TrainingWorker.train_mini_batch`` of the actor and of the critic (verl's
mini-batches, engine, loss functions and all-gather of the metrics, around a stand-in model:
tests/integration/update_workers.py). The driver fetches every rank's output (verl's collect keeps
the first); the bytes counted are those of the update tables in all of them, pickled as Ray ships
them. ``new``: verl-ext as installed. ``old``: the same run without verl-ext's patch of
``train_mini_batch``, i.e. the reports in the loss metrics, through verl's all-gather, as before it.
Prints one line per rank count and path, ending ``ranks=N bytes=B``; asserts nothing.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the harness lives in tests/

from tests.integration.update_workers import UpdateJob, driver_keeps, run_ranks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--samples", type=int, default=64, help="responses per step (a multiple of 2 x the largest rank count)")
    parser.add_argument("--response", type=int, default=256, help="longest response, tokens")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    from verl.utils import tensordict_utils as tu

    from verl_ext.integration.update_hook import PAYLOAD_KEY

    job = UpdateJob(
        patched=(True, False), samples=args.samples, prompt_length=16, response_length=args.response,
        mini_batch_size=args.samples // 2, micro_batch_size=2, epochs=args.epochs,
    )  # fmt: skip
    answers = run_ranks(sorted(set(args.ranks)), job)

    def driver_bytes(world: list, patched: bool) -> int:
        total = 0
        for kind in job.kinds:
            outputs = [answer[kind, patched] for answer in world]
            kept = tu.get(driver_keeps(outputs), "metrics")  # verl's collect: what the trainer reads
            assert PAYLOAD_KEY in kept, f"{kind}: the driver's output has no update table"
            payloads = [tu.get(output, "metrics").get(PAYLOAD_KEY) for output in outputs]
            total += sum(len(pickle.dumps(p, protocol=5)) for p in payloads if p is not None)
        return total

    print(f"update tables (actor + critic) reaching the driver per traced step: {args.samples} responses of "
          f"1-{args.response} tokens, {args.epochs} epochs of 2 mini-batches")  # fmt: skip
    for patched, name in ((True, "new"), (False, "old")):
        for ranks, world in sorted(answers.items()):
            path = "(one gather to rank 0)" if patched else "(verl all-gather, every output)"
            print(f"{name} {path} ranks={ranks} bytes={driver_bytes(world, patched)}")


if __name__ == "__main__":
    sys.exit(main())
