"""Plot `pagefleet bench paging` results: usage: plot_paging.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def color(kind):
    return {"Local": "black", "Region": "tab:blue", "SwapFile": "tab:red", "SwapSsd": "tab:purple", "Zram": "tab:orange", "Floor": "tab:green"}.get(kind, "grey")


def main(src, dst):
    r = json.load(open(src))
    rows = [x for x in r["rows"] if not x.get("error") and x["cfg"].get("workload", "kv") == "kv"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 6), gridspec_kw={"width_ratios": [2.2, 1.4, 1]})
    ax = axes[0]
    names = [x["cfg"]["name"] for x in rows]
    ax.barh(range(len(rows)), [x["ratio_to_local"] for x in rows], color=[color(x["cfg"]["kind"]) for x in rows])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(0.9, color="grey", ls=":", lw=1)
    ax.set_xlabel("kv ops/s relative to all-local")
    ax.set_title(f"kv guest, zipf θ={r['theta']}, {r['size_bytes'] >> 20} MiB")
    ax.grid(alpha=0.3, axis="x")
    ax = axes[1]
    for x in rows:
        if x["rounds"]:
            ax.plot(range(1, len(x["rounds"]) + 1), x["rounds"], color=color(x["cfg"]["kind"]), alpha=0.7, lw=1)
    ax.set_xlabel("interleaved round")
    ax.set_ylabel("ops/s")
    ax.set_yscale("log")
    ax.set_title("throughput over time (blue: pagefleet, red: swap file, orange: zram)")
    ax.grid(alpha=0.3)
    ax = axes[2]
    f = r["faults"]
    ax.bar(range(len(f)), [x["p50_us"] for x in f], 0.4, label="p50", color="tab:blue")
    ax.bar([i + 0.4 for i in range(len(f))], [x["p99_us"] for x in f], 0.4, label="p99", color="lightgrey")
    ax.set_xticks([i + 0.2 for i in range(len(f))])
    ax.set_xticklabels([x["what"] for x in f], fontsize=7, rotation=15)
    ax.set_ylabel("µs")
    ax.set_title("single 4 KiB fault")
    ax.legend(fontsize=8)
    met = sum(g["met"] for g in r["goals"])
    fig.suptitle(f"pagefleet paging vs all-local, swap (virtual disk, SSD-like) and zram — goals met {met}/{len(r['goals'])}")
    fig.tight_layout()
    fig.savefig(dst, dpi=100)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
