"""Plot bench/cluster.py results: sync time per configuration against its wire floor.

Usage::

    python bench/plot_cluster.py bench/results/cluster/cluster.json [out.png]

One panel per (gradient set, link rate): a horizontal bar per configuration (baselines
grey, HiPress blue; log scale), a black tick at the configuration's wire floor; one
panel per link rate with the training benchmark's images/s when there are training rows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List

ORDER = ("horovod", "ddp", "grace", "byteps", "hipress-ps", "hipress-ring")


def plot(rows: List[Dict[str, Any]], png: Path) -> None:
    """Draw ``rows`` (bench/cluster.py's annotated rows) into ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sync = [r for r in rows if r.get("kind") == "sync"
            and not (r["system"] == "ddp" and r["codec"] == "noop")]
    train = [r for r in rows if r.get("kind") == "training" and r.get("images_per_s")]
    panels = sorted({(r["model"], r["rate"]) for r in sync})
    train_rates = sorted({r["rate"] for r in train})
    if not panels and not train_rates:
        return
    heights = [max(2.0, 0.28 * sum(1 for r in sync if (r["model"], r["rate"]) == p) + 1.0)
               for p in panels]
    heights += [max(2.0, 0.28 * sum(1 for r in train if r["rate"] == t) + 1.0)
                for t in train_rates]
    fig, axes = plt.subplots(len(heights), 1, figsize=(9, sum(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, rate in zip(axes[len(panels):, 0], train_rates):
        grp = [r for r in train if r["rate"] == rate]
        y = list(range(len(grp)))
        ax.barh(y, [r["images_per_s"] for r in grp],
                color=["#999999" if r["codec"] == "none" else "#1f77b4" for r in grp])
        for i, r in enumerate(grp):
            ax.text(r["images_per_s"], i, f" {r['images_per_s']:.1f}", va="center", fontsize=7)
        ax.set_yticks(y)
        ax.set_yticklabels([f"{r['system']} {r['codec']}" for r in grp], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("training throughput, images/s (all ranks)", fontsize=8)
        ax.set_title(f"synthetic-data CNN training, {rate} links", fontsize=9)
    for ax, (model, rate) in zip(axes[:len(panels), 0], panels):
        grp = sorted((r for r in sync if (r["model"], r["rate"]) == (model, rate)),
                     key=lambda r: (ORDER.index(r["system"]) if r["system"] in ORDER else 9,
                                    r["codec"], r.get("plan", "")))
        labels = [(f"horovod ({r.get('path') or 'ompi'})" if r["system"] == "horovod"
                   else f"{r['system']} {r['codec']}")
                  + (f" plan={r['plan']}" if r.get("plan") and r["plan"] != "none" else "")
                  for r in grp]
        times = [r["time_s"] for r in grp]
        colors = ["#1f77b4" if r["system"].startswith("hipress") else "#999999" for r in grp]
        y = list(range(len(grp)))
        ax.barh(y, times, color=colors)
        for i, r in enumerate(grp):
            if r.get("floor_s"):
                ax.plot([r["floor_s"]] * 2, [i - 0.4, i + 0.4], color="black", lw=2)
            ax.text(times[i], i, f" {times[i]:.2f}s", va="center", fontsize=7)
        ax.set_yticks(y)
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("per-iteration sync time, s (log; black tick = wire floor)", fontsize=8)
        ax.set_title(f"{model}, {rate} links", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    src = Path(sys.argv[1])
    data = json.loads(src.read_text())
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else src.with_suffix(".png")
    plot(data["rows"] if isinstance(data, dict) else data, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
