"""The live critic metrics of a CPU run over its steps, as a logger would draw them, from its metrics.jsonl.

    python scripts/plot_live_metrics.py RUN_DIR OUT.png

One line per decile ``verl_ext/critic/ev_mc/d0`` … ``d9`` (early positions light, late ones dark),
with ``ev_mc`` (all tokens), ``ev_mc_last`` and verl's own ``critic/vf_explained_var`` for comparison.
(docs/live_metrics_demo.png is this plot of ``make demo``'s run.)
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(run_dir: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verl_ext.apps.learning import read_metrics

    metrics = {step: data for step, data in read_metrics(Path(run_dir)).items() if "verl_ext/critic/ev_mc" in data}
    steps = sorted(metrics)

    def series(key):
        return [metrics[s].get(key, float("nan")) for s in steps]

    figure, axis = plt.subplots(figsize=(8, 4.5), dpi=110)
    colours = plt.get_cmap("viridis_r")
    for decile in range(10):
        axis.plot(steps, series(f"verl_ext/critic/ev_mc/d{decile}"), color=colours(0.1 + 0.09 * decile), lw=1.4, label=f"ev_mc/d{decile}")
    axis.plot(steps, series("verl_ext/critic/ev_mc_last"), color="crimson", lw=2, ls="--", label="ev_mc_last")
    axis.plot(steps, series("verl_ext/critic/ev_mc"), color="black", lw=2, label="ev_mc (all tokens)")
    axis.plot(steps, series("critic/vf_explained_var"), color="grey", lw=1.5, ls=":", label="verl's critic/vf_explained_var")
    axis.axhline(0, color="grey", lw=0.6)
    axis.set(xlabel="training step", ylabel="explained variance", ylim=(-0.3, 1.02), title="verl_ext/critic/ev_mc by decile of the response")
    axis.grid(alpha=0.3)
    axis.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    figure.tight_layout()
    figure.savefig(out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
