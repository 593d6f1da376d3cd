"""Plot `pagefleet bench scale`: one panel per sweep. usage: plot_scale.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def ok(points):
    return [p for p in points if not p.get("error")]


def main(src, dst):
    r = json.load(open(src))
    panels = [k for k in ("registry", "lend", "servers", "guests", "migration") if r.get(k)]
    if not panels:
        panels = ["registry"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, k in zip(axes[0], panels):
        pts = ok(r.get(k, []))
        if k == "registry":
            xs = [p["hosts"] for p in pts]
            ax.plot(xs, [p["placement_p99_ms"] for p in pts], "o-", label="placement p99 (mirror)")
            ax.plot(xs, [p["direct_view_p50_ms"] for p in pts], "s--", label="reading etcd instead, p50")
            ax.axhline(50, color="#c0392b", linestyle=":", label="goal 50 ms (10 000)")
            ax.axhline(100, color="#e67e22", linestyle=":", label="goal 100 ms (50 000)")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("simulated hosts")
            ax.set_ylabel("ms")
            ax.set_title("registry")
        elif k == "lend":
            xs = [p["lend_bytes"] / 2**30 for p in pts]
            ax.plot(xs, [p["page_out_gbps"] for p in pts], "o-", label="page-out GB/s")
            ax.plot(xs, [p["page_in_gbps"] for p in pts], "s-", label="page-in GB/s")
            ax2 = ax.twinx()
            ax2.plot(xs, [p["overhead_pct"] for p in pts], "^:", color="#c0392b", label="RSS over --lend, %")
            ax2.set_ylabel("RSS over --lend, %")
            ax2.legend(loc="lower right", fontsize=8)
            ax.set_xlabel("--lend, GiB")
            ax.set_ylabel("GB/s")
            ax.set_title("one memory server")
        elif k == "servers":
            xs = [p["servers"] for p in pts]
            ax.plot(xs, [p["ratio_to_local"] for p in pts], "o-", label="ops/s over all local")
            ax2 = ax.twinx()
            ax2.plot(xs, [p["threads"] for p in pts], "s:", color="#7f8c8d", label="threads")
            ax2.plot(xs, [p["fds"] for p in pts], "^:", color="#8e44ad", label="fds")
            ax2.set_ylabel("count")
            ax2.legend(loc="lower right", fontsize=8)
            ax.set_xlabel("memory servers (0: all local)")
            ax.set_ylabel("ratio")
            ax.set_title("one kv guest, 50% budget")
        elif k == "migration":
            for w, d, st in [("idle", "enough", "o-"), ("idle", "split", "s-"),
                             ("rewrite", "enough", "o--"), ("rewrite", "split", "s--")]:
                q = [p for p in pts if p["workload"] == w and p["dest"] == d]
                ax.plot([p["size"] / 2**30 for p in q], [p["secs_per_gib"] for p in q], st, label=f"{w} -> {d}")
                f = [p for p in q if p.get("floor")]
                if w == "idle" and f:
                    ax.plot([p["size"] / 2**30 for p in f], [p["floor_secs_per_gib"] for p in f], ":",
                            marker=st[0], color=ax.lines[-1].get_color(), label=f"floor -> {d}")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("guest memory, GiB")
            ax.set_ylabel("seconds per GiB")
            ax.set_ylim(bottom=0)
            ax.set_title("migration, 10 Gbit lab link")
        else:
            xs = [p["guests"] for p in pts]
            ax.plot(xs, [p["ratio"] for p in pts], "o-", label="aggregate paging / all local")
            ax.plot(xs, [p["slowest_over_fastest"] for p in pts], "s-", label="slowest / fastest guest")
            ax.plot(xs, [p.get("floor_ratio", 0) for p in pts], "^--", label="floor pager / all local")
            ax.axhline(0.8, color="#c0392b", linestyle=":", label="fairness goal 0.8")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("kv guests on the host")
            ax.set_ylabel("ratio")
            ax.set_title("guests sharing two servers")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
