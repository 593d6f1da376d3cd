"""Plot `pagefleet bench registry`: placement latency distribution. usage: plot_registry.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    r = json.load(open(src))
    ms = sorted(r["placement_ms"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ys = [(i + 1) / len(ms) for i in range(len(ms))]
    ax.plot(ms, ys, color="#2a7ab9")
    ax.axvline(50, color="#c0392b", linestyle="--", label="goal: p99 ≤ 50 ms")
    ax.axvline(r["placement_p99_ms"], color="#2a7ab9", linestyle=":", label=f"p99 {r['placement_p99_ms']:.1f} ms")
    ax.set_xlabel("placement latency, ms (read registry, choose, claim, release)")
    ax.set_ylabel("fraction of placements")
    ax.set_title(f"etcd registry: {r['opts']['hosts']} hosts, {r['opts']['guests']} guests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
