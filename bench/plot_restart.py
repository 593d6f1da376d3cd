"""Plot `pagefleet bench restart`: each guest's longest kv operation per in-place restart. usage: plot_restart.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    r = json.load(open(src))
    runs = r["restarts"]
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(1, len(runs) + 1))
    for g, (name, color) in enumerate([("ip1 (on h1)", "#2a7ab9"), ("ip2 (on h1)", "#27ae60"), ("ip3 (on h2, pages on h1)", "#8e44ad")]):
        ax.plot(xs, [x["longest_op_ms"][g] for x in runs], marker="o", color=color, label=name)
    ax.plot(xs, [x["answered_secs"] * 1000 for x in runs], marker="s", linestyle=":", color="#7f8c8d", label="restart answered (CLI)")
    ax.axhline(1000, color="#c0392b", linestyle="--", label="goal: ≤ 1000 ms")
    ax.set_xlabel("restart")
    ax.set_ylabel("ms")
    ax.set_xticks(xs)
    ax.set_title(f"in-place restart of h1's pagefleetd, kv guests of {r['opts']['guest_mib']} MiB")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
