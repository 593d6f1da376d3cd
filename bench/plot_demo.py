"""Plot `pagefleet demo` results: usage: plot_demo.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    r = json.load(open(src))
    tl = r["timeline"]
    t = [i * 0.1 for i in range(len(tl))]
    sm = [sum(tl[max(0, i - 9):i + 1]) / len(tl[max(0, i - 9):i + 1]) for i in range(len(tl))]
    fig, ax = plt.subplots(figsize=(12, 5))
    ax.plot(t, tl, color="tab:blue", alpha=0.25, lw=0.8, label="per 100 ms")
    ax.plot(t, sm, color="tab:blue", lw=2, label="1 s average")
    colors = {"split migration": "tab:orange", "gather": "tab:green"}
    for name, a, b in r["phases"]:
        ax.axvspan(a, max(b, a + 0.1), color=colors.get(name, "grey"), alpha=0.3, label=name)
    s0, s1 = r["phases"][0][1], r["phases"][0][2]
    g0 = r["phases"][1][1]
    ymax = max(tl) if tl else 1
    ax.text(s0 / 2, ymax * 1.02, "on h1", ha="center")
    ax.text((s1 + g0) / 2, ymax * 1.02, "main h2 + sub-host h3", ha="center")
    ax.text((r["phases"][1][2] + t[-1]) / 2 if t else 0, ymax * 1.02, "gathered on h1", ha="center")
    ax.set_ylim(0, ymax * 1.1)
    ax.set_xlabel("seconds")
    vm = r.get("workload") == "vm"
    ax.set_ylabel("in-guest ops/s (vmwork)" if vm else "kv ops/s")
    what = "QEMU VM" if vm else "kv guest"
    ax.set_title(f"pagefleet demo: a {r['size_bytes'] >> 20} MiB {what} split-migrates, pages, and is gathered back")
    ax.legend(loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
