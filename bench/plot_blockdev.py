"""Plot `pagefleet bench blockdev` results: usage: plot_blockdev.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    r = json.load(open(src))
    rows = [x for x in r["rows"] if not x.get("error")]
    targets = []
    for x in rows:
        if x["target"] not in targets:
            targets.append(x["target"])
    keys = []
    for x in rows:
        k = (x["rw"], x["bs"], x["iodepth"])
        if k not in keys:
            keys.append(k)
    fig, axes = plt.subplots(2, 1, figsize=(max(12, len(keys) * 0.8), 10))
    w = 0.8 / max(1, len(targets))
    for metric, ax, label in [("iops", axes[0], "IOPS"), ("mb_per_s", axes[1], "MB/s")]:
        for i, t in enumerate(targets):
            # One bar per target and row: the mean over rounds, the
            # whisker from the worst round to the best.
            vals, lo, hi = [], [], []
            for k in keys:
                v = [x[metric] for x in rows if x["target"] == t and (x["rw"], x["bs"], x["iodepth"]) == k]
                m = sum(v) / len(v) if v else 0
                vals.append(m)
                lo.append(m - min(v) if v else 0)
                hi.append(max(v) - m if v else 0)
            ax.bar([j + i * w for j in range(len(keys))], vals, w, label=t, yerr=[lo, hi], capsize=2)
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(keys))])
        ax.set_xticklabels([f"{k[0]}\n{k[1] >> 10}K qd{k[2]}" for k in keys], fontsize=7)
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    rounds = max([x.get("round", 1) for x in rows] or [1])
    axes[0].set_title(
        f"NBD exports over loopback (fio nbd engine), {r['size_bytes'] >> 20} MiB device; "
        f"mean of {rounds} round(s), whiskers worst to best"
    )
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
