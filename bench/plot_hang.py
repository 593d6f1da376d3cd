"""Plot `pagefleet bench hang`: the kv clients' rate and the guest's resident memory against its budget around a memory server's stop, every run. usage: plot_hang.py RESULTS.json OUT.png"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src, dst):
    r = json.load(open(src))
    stop = r["opts"]["stop_secs"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for i, run in enumerate(r["runs"]):
        tl = run["timeline"]
        xs = [p[0] for p in tl]
        top.plot(xs, [p[1] for p in tl], linewidth=0.8, label=f"run {i + 1}" if i < 10 else None)
        bottom.plot(xs, [p[2] for p in tl], linewidth=0.8)
        top.axhline(run["pre_fault_ops"] * 0.5, color="#bbbbbb", linewidth=0.5, linestyle=":")
    for ax in (top, bottom):
        ax.axvspan(0, stop, color="#f5d6d6", alpha=0.5, label="server stopped" if ax is top else None)
    bottom.axhline(1.05, color="#c0392b", linestyle="--", label="goal: ≤ budget + 5%")
    top.set_ylabel("kv ops/s (0.5 s windows)")
    bottom.set_ylabel("resident / budget")
    bottom.set_xlabel("s since the stop")
    top.set_title(f"a memory server stopped {stop} s under a --replicas 2 kv guest ({r['opts']['guest_mib']} MiB)")
    top.legend(fontsize=7, ncol=3)
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
