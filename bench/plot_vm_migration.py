"""Plot `pagefleet bench vm-migration` results: usage: plot_vm_migration.py RESULTS.json OUT.png"""
import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "qemu-precopy": "black",
    "qemu-postcopy": "tab:gray",
    "qemu-swap": "tab:red",
    "pagefleet-split": "tab:blue",
    "pagefleet-enough": "tab:green",
    "qemu-multifd": "tab:purple",
    "qemu-postcopy-preempt": "tab:orange",
}


def ok(v):
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def main(src, dst):
    r = json.load(open(src))
    rows = [x for x in r["rows"] if not x.get("error")]
    workloads = []
    for x in rows:
        if x["workload"] not in workloads:
            workloads.append(x["workload"])
    deb = [x for x in r.get("debian", []) if not x.get("error")]
    n = max(1, len(workloads) + (1 if deb else 0))
    fig, axes = plt.subplots(n, 3, figsize=(17, 4.5 * n), squeeze=False)
    if deb:
        debian_panels(axes[len(workloads)], deb)
    for i, wl in enumerate(workloads):
        sub = [x for x in rows if x["workload"] == wl]
        ax = axes[i][0]
        for x in sub:
            t = [p[0] for p in x["timeline"]]
            v = [p[1] for p in x["timeline"]]
            ax.plot(t, v, label=x["mode"], color=COLORS.get(x["mode"]))
        ax.axvline(0, color="gray", ls=":")
        ax.set_xlabel("seconds since the migration started")
        ax.set_ylabel("in-guest ops/s")
        ax.set_title(f"{wl}: vmwork throughput across the migration")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        names = [x["mode"] for x in sub]
        cols = [COLORS.get(m) for m in names]
        ax = axes[i][1]
        ax.bar(range(len(sub)), [x["total_secs"] if ok(x["total_secs"]) else 0 for x in sub], color=cols)
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.set_ylabel("seconds")
        ax.set_title(f"{wl}: migration time")
        ax.grid(alpha=0.3, axis="y")
        ax = axes[i][2]
        ax.bar(range(len(sub)), [x["downtime_ms"] if ok(x["downtime_ms"]) else 0 for x in sub], color=cols)
        ax.set_xticks(range(len(sub)))
        ax.set_xticklabels(names, rotation=20, fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(f"{wl}: downtime")
        ax.grid(alpha=0.3, axis="y")
    if rows:
        fig.suptitle(f"VM of {r['size_bytes'] >> 20} MiB, {r['link']} link")
    else:
        fig.suptitle(f"Debian VM with memcached, {r['link']} link")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


def debian_panels(axes, deb):
    """Migration time, downtime and client ops/s after/before by VM size, per mode."""
    modes = []
    for x in deb:
        if x["mode"] not in modes:
            modes.append(x["mode"])
    sizes = sorted({x["size_bytes"] for x in deb})
    width = 0.8 / max(1, len(modes))
    panels = [
        ("total_secs", "seconds", "Debian VM: migration time"),
        ("downtime_ms", "ms", "Debian VM: downtime"),
        (None, "ratio", "Debian VM: client ops/s after / before (0: clients lost)"),
    ]
    for ax, (key, unit, title) in zip(axes, panels):
        for j, m in enumerate(modes):
            vals = []
            for s in sizes:
                # A QEMU pre-copy may have run twice (its first VM died after
                # the move): the working attempt, else the first.
                tries = [y for y in deb if y["mode"] == m and y["size_bytes"] == s]
                x = next((y for y in tries if ok(y["ops_after"]) and y["ops_after"] > 0), None)
                x = x or (tries[0] if tries else None)
                if x is None:
                    vals.append(0)
                elif key is None:
                    b, a = x["ops_before"], x["ops_after"]
                    vals.append(a / b if ok(a) and ok(b) and b > 0 else 0)
                else:
                    vals.append(x[key] if ok(x[key]) else 0)
            ax.bar([i + j * width for i in range(len(sizes))], vals, width, label=m, color=COLORS.get(m))
        ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(sizes))])
        ax.set_xticklabels([f"{s >> 20} MiB" for s in sizes])
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
