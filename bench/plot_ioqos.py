"""Plot `pagefleet bench ioqos` results as stacked per-tenant throughput
(like paper 004's Figs. 3-4): one row per device/scenario, one column per
policy. usage: plot_ioqos.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    r = json.load(open(src))
    runs = [x for x in r["runs"] if x["t"]]
    rows = []
    for x in runs:
        k = (x["device"], x["scenario"])
        if k not in rows:
            rows.append(k)
    cols = []
    for x in runs:
        if x["policy"] not in cols:
            cols.append(x["policy"])
    if not rows:
        return
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(4.2 * len(cols), 3.2 * len(rows)),
                             sharex=True, squeeze=False)
    for i, (d, s) in enumerate(rows):
        top = max((sum(v[j] for v in x["bps"]) for x in runs
                   if (x["device"], x["scenario"]) == (d, s) for j in range(len(x["t"]))), default=1) / 1e6
        for j, p in enumerate(cols):
            ax = axes[i][j]
            x = next((x for x in runs if (x["device"], x["scenario"], x["policy"]) == (d, s, p)), None)
            if x is None:
                ax.axis("off")
                continue
            names = [t["name"] for t in x["tenants"]]
            ys = [[v / 1e6 for v in series] for series in x["bps"]]
            ax.stackplot(x["t"], ys, labels=names, linewidth=0)
            wb = [t for t in x["tenants"] if t["well_behaved"]]
            if wb:
                ax.axhline(wb[0]["min_bps"] / 1e6, color="k", ls=":", lw=1)
            ax.set_ylim(0, top * 1.1)
            iso = x["worst_isolation"] * 100
            wc = x.get("work_conservation")
            ax.set_title(f"{d}/{s}: {p}\nworst {iso:.0f}% of min" + (f", {wc * 100:.0f}% of none" if wc else ""),
                         fontsize=9)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("MB/s (stacked)")
            if i == len(rows) - 1:
                ax.set_xlabel("s")
            if j == len(cols) - 1 and len(names) <= 12:
                ax.legend(fontsize=6, loc="upper right", ncol=2)
    fig.suptitle("Per-tenant write throughput on a shared device (dotted: a well-behaved tenant's minimum)")
    fig.tight_layout()
    fig.savefig(dst, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
