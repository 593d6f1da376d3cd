"""Plot `pagefleet bench ksm` results: usage: plot_ksm.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    r = json.load(open(src))
    cs = [c for c in r["configs"] if not c.get("error") and c["samples"]]
    paging = r["opts"].get("swap") is not None
    fig, axes = plt.subplots(4 if paging else 3, 1, figsize=(11, 14 if paging else 11), sharex=True)
    # One color per policy; its rounds as solid, dashed, dotted lines.
    colors = {}
    styles = ["-", "--", ":", "-."]
    for c in cs:
        color = colors.setdefault(c["name"], f"C{len(colors) % 10}")
        rnd = c.get("round", 0)
        kw = dict(color=color, linestyle=styles[rnd % len(styles)], linewidth=1.2)
        label = c["name"] if rnd == 0 else None
        t = [s["t"] for s in c["samples"]]
        axes[0].plot(t, [s["saved_mib"] for s in c["samples"]], label=label, **kw)
        axes[1].plot(t, [s["ksmd_cpu_pct"] for s in c["samples"]], label=label, **kw)
        axes[2].plot(t, [s["ops_per_s"] for s in c["samples"]], label=label, **kw)
        if paging:
            axes[3].plot(t, [s.get("majflt_per_s", 0) for s in c["samples"]], label=label, **kw)
    axes[0].set_ylabel("memory saved (MiB)")
    axes[1].set_ylabel("ksmd CPU (% of a core)")
    axes[2].set_ylabel("tenant throughput (ops/s, sum)")
    if paging:
        axes[3].set_ylabel("major page faults/s (host)")
    axes[-1].set_xlabel("seconds since the tenants were loaded")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    o = r["opts"]
    axes[0].set_title(f"KSM policies: {o['tenants']} kv tenants x {o['tenant_bytes'] >> 20} MiB under memory pressure, {o.get('rounds', 1)} round(s) (solid, dashed, dotted)")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
