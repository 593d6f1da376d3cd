"""Plot `pagefleet bench soak`: RSS (a pagefleetd's without its lending pool and content index), fds and threads of every process over time, events marked. usage: plot_soak.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    r = json.load(open(src))
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for p in r["procs"]:
        t = [x / 60 for x in p["t"]]
        rss = [a - b - c for a, b, c in zip(p["rss_mib"], p["pool_mib"], p["index_mib"])]
        if p["rss_growth_pct"] is None:
            # Short-lived (incoming runners, restarted servers): grey, no legend.
            style = dict(color="#999999", linewidth=0.6, alpha=0.6)
            label = None
        else:
            style = dict(linewidth=1.4)
            label = f"{p['host']} {p['what']} (RSS {p['rss_growth_pct']:+.1f}%)"
        axes[0].plot(t, rss, label=label, **style)
        axes[1].plot(t, p["fds"], **style)
        axes[2].plot(t, p["threads"], **style)
    for e in r["events"]:
        if e["what"].startswith("kill"):
            for ax in axes:
                ax.axvline(e["t"] / 60, color="#c0392b", alpha=0.15, linewidth=0.8)
    axes[0].set_ylabel("RSS, MiB\n(pagefleetd: less pool and index)")
    axes[1].set_ylabel("open fds")
    axes[2].set_ylabel("threads")
    axes[2].set_xlabel("minutes (red: a memory server killed -9; grey: short-lived processes)")
    axes[0].set_title(
        f"soak: {r['secs'] / 60:.0f} min, {r['guests']} kv guests with 2 replicas, bytes lost {r['bytes_lost']}"
    )
    axes[0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
