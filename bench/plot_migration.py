"""Plot `pagefleet bench migration` results: usage: plot_migration.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"enough": "black", "split": "tab:blue", "split-nohist": "tab:cyan", "swap": "tab:red"}


def bars(ax, rows, key, title, ylabel):
    groups = []
    for x in rows:
        g = f"{x['link']}\n{x['workload']}"
        if g not in groups:
            groups.append(g)
    dests = ["enough", "split", "swap"]
    w = 0.26
    for i, d in enumerate(dests):
        vals = []
        for g in groups:
            v = [x[key] for x in rows if f"{x['link']}\n{x['workload']}" == g and x["dest"] == d]
            vals.append(v[0] if v else 0)
        ax.bar([j + (i - 1) * w for j in range(len(groups))], vals, w, label=d, color=COLORS[d])
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3, axis="y")


def sort_panel(ax, r):
    names = [x["dest"] for x in r["sort"]]
    ax.bar(names, [x["sort_secs"] for x in r["sort"]], color=[COLORS.get(n, "grey") for n in names])
    for i, x in enumerate(r["sort"]):
        ax.annotate(f"{x['page_ins']} page-ins", (i, x["sort_secs"]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("sort time after migration, s")
    ax.set_title("sort of 40% of the guest after migration (Fig. 11)")
    ax.grid(alpha=0.3, axis="y")


def kv_panel(ax, r):
    # The first round of each destination drawn; the label gives every
    # round's recovery (the goals take their median).
    for x in [x for x in r["kv"] if x.get("round", 0) == 0]:
        tl = x["timeline"]
        t = [i * 0.1 - x["migrate_start"] for i in range(len(tl))]
        # 1-s moving average for readability
        sm = [sum(tl[max(0, i - 9):i + 1]) / len(tl[max(0, i - 9):i + 1]) for i in range(len(tl))]
        recs = ", ".join("never" if y["recovery_secs"] is None else f"{y['recovery_secs']:.1f}" for y in r["kv"] if y["dest"] == x["dest"])
        ax.plot(t, sm, color=COLORS.get(x["dest"], "grey"), label=f"{x['dest']} (recovery {recs} s)")
        ax.axvspan(0, x["migrate_end"] - x["migrate_start"], color=COLORS.get(x["dest"], "grey"), alpha=0.08)
    ax.axvline(0, color="grey", ls=":")
    ax.set_xlabel("seconds from migration start")
    ax.set_ylabel("kv ops/s (1 s average)")
    ax.set_title("kv throughput across the migration (Fig. 12)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def main(src, dst):
    r = json.load(open(src))
    size = r["size_bytes"] >> 20
    # Only the parts that ran (`--only`) get a panel: no empty axes.
    panels = []
    if r["time"]:
        panels.append(lambda ax: bars(ax, r["time"], "total_secs", f"migration time, {size} MiB guest (Figs. 8-10)", "seconds"))

        def downtime(ax):
            bars(ax, r["time"], "downtime_ms", "downtime", "ms")
            ax.set_yscale("log")

        panels.append(downtime)
    if r["sort"]:
        panels.append(lambda ax: sort_panel(ax, r))
    if r["kv"]:
        panels.append(lambda ax: kv_panel(ax, r))
    if not panels:
        panels.append(lambda ax: ax.set_title("nothing was measured"))
    cols = 1 if len(panels) == 1 else 2
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 5 * rows), squeeze=False)
    flat = [a for row in axes for a in row]
    for draw, ax in zip(panels, flat):
        draw(ax)
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
