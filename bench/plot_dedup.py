"""Plot `pagefleet bench dedup` results (like paper 002's Fig. 4): usage: plot_dedup.py RESULTS.json OUT.png"""
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    r = json.load(open(src))
    rows = [x for x in r["rows"] if not x.get("error") and x.get("case", "synthetic") == "synthetic"]
    links = sorted({x["link"] for x in rows})
    fig, axes = plt.subplots(len(links), 2, figsize=(12, 4.2 * len(links)), squeeze=False)
    for i, link in enumerate(links):
        by = defaultdict(list)
        for x in rows:
            if x["link"] == link:
                by[(x["shared"], x["mode"])].append(x)
        levels = sorted({k[0] for k in by})
        pos = range(len(levels))
        w = 0.38
        for j, (mode, color) in enumerate([("plain", "#888888"), ("dedup", "#2a7ab9")]):
            def mean(key):
                out = []
                for lv in levels:
                    v = [x[key] for x in by.get((lv, mode), [])]
                    out.append(sum(v) / len(v) if v else 0)
                return out
            off = [p + (j - 0.5) * w for p in pos]
            axes[i][0].bar(off, [b / 2**20 for b in mean("bytes")], w, label=mode, color=color)
            axes[i][1].bar(off, mean("total_secs"), w, label=mode, color=color)
        labels = [f"{lv * 100:.1f}%" for lv in levels]
        for ax, yl in zip(axes[i], ["MiB sent to the destination", "migration time (s)"]):
            ax.set_xticks(list(pos))
            ax.set_xticklabels(labels)
            ax.set_xlabel("pages whose content the destination holds")
            ax.set_ylabel(yl)
            ax.set_title(f"{link} link")
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=8)
    size = r["opts"]["size"] >> 20
    fig.suptitle(f"sharing-aware migration of a {size} MiB guest: plain vs dedup")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
