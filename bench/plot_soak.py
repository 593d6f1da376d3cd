"""Plot `pagefleet bench soak`: RSS, fds and threads of every process over time, events marked. usage: plot_soak.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    r = json.load(open(src))
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for p in r["procs"]:
        label = f"{p['host']} {p['what']}"
        t = [x / 60 for x in p["t"]]
        axes[0].plot(t, p["rss_mib"], label=label, linewidth=1)
        axes[1].plot(t, p["fds"], linewidth=1)
        axes[2].plot(t, p["threads"], linewidth=1)
    for e in r["events"]:
        if e["what"].startswith("kill"):
            for ax in axes:
                ax.axvline(e["t"] / 60, color="#c0392b", alpha=0.25, linewidth=0.8)
    axes[0].set_ylabel("RSS, MiB")
    axes[1].set_ylabel("open fds")
    axes[2].set_ylabel("threads")
    axes[2].set_xlabel("minutes (red: a memory server killed -9)")
    axes[0].set_title(
        f"soak: {r['secs'] / 60:.0f} min, {r['guests']} kv guests with 2 replicas, bytes lost {r['bytes_lost']}"
    )
    axes[0].legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
