"""Plot `pagefleet bench memserver` results: usage: plot_memserver.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    r = json.load(open(src))
    tp = r["throughput"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2))
    colors = {"pagefleet": "tab:blue", "memcached": "tab:orange", "raw TCP": "black"}
    for ax, op in zip(axes[:2], ["page-out", "page-in"]):
        for system in ["pagefleet", "memcached"]:
            for conns, style in [(1, "-o"), (4, "--s")]:
                rows = sorted((x for x in tp if x["system"] == system and x["op"] == op and x["conns"] == conns),
                              key=lambda x: x["batch_kib"])
                if rows:
                    ax.plot([x["batch_kib"] for x in rows], [x["gbps"] for x in rows], style,
                            color=colors[system], label=f"{system}, {conns} conn")
        for x in tp:
            if x["system"] == "raw mem" and x["op"] == op:
                ax.axhline(x["gbps"], color="tab:green", ls=":" if x["conns"] == 1 else "-.", lw=1,
                           label=f"raw TCP into memory, {x['conns']} stream")
            if x["system"] == "raw TCP" and x["op"] == op:
                ax.axhline(x["gbps"], color="black", ls=":" if x["conns"] == 1 else "-.", lw=1,
                           label=f"raw TCP, {x['conns']} stream")
                ax.axhline(0.8 * x["gbps"], color="grey", ls=":", lw=0.6) if x["conns"] == 1 else None
        ax.set_xscale("log", base=2)
        ax.set_xticks([4, 16, 64, 128])
        ax.set_xticklabels(["4K", "16K", "64K", "128K"])
        ax.set_xlabel("batch per frame (KiB)")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{op} throughput (loopback)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[2]
    lat = r["latency"]
    labels = [f"{x['system']}\n{x['shape']}" for x in lat]
    xs = range(len(lat))
    ax.bar([i - 0.2 for i in xs], [x["p50_us"] for x in lat], 0.4, label="p50",
           color=[colors.get(x["system"], "grey") for x in lat])
    ax.bar([i + 0.2 for i in xs], [x["p99_us"] for x in lat], 0.4, label="p99", color="lightgrey")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("round trip (µs)")
    ax.set_title("one 4 KiB page, one connection")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    met = sum(g["met"] for g in r["goals"])
    fig.suptitle(f"pagefleet memory server vs raw TCP and memcached — goals met {met}/{len(r['goals'])}; "
                 f"RSS overhead at 1 GiB: {r['rss']['overhead_pct']:.2f}%")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
