"""Plot `pagefleet bench dashboard`: each pagefleetd's CPU share with 0, 1 and N dashboards open on h1. usage: plot_dashboard.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    r = json.load(open(src))
    phases = r["phases"]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.25
    xs = list(range(len(phases)))
    for h, (name, color) in enumerate([("h1 (serves the page)", "#2a7ab9"), ("h2", "#27ae60"), ("h3", "#8e44ad")]):
        ax.bar([x + (h - 1) * width for x in xs], [p["cpu_pct"][h] for p in phases], width, color=color, label=name)
    ax.axhline(phases[0]["cpu_pct"][0] + 1.0, color="#c0392b", linestyle="--", label="goal for h1: ≤ its share without viewers + 1 % of a core")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{p['viewers']} viewers\n{p['min_events_per_s']:.2f} snapshots/s each" for p in phases])
    ax.set_ylabel("pagefleetd CPU, % of one core")
    ax.set_title(f"web dashboard live updates, {r['opts']['secs']} s per phase")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
