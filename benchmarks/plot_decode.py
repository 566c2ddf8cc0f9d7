"""Plot decode total µs against context, one line per batch size, from `python -m m3sparse bench --json` files.

usage: python benchmarks/plot_decode.py OUT.png LABEL=bench.json [LABEL=bench.json ...]
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv: list[str]) -> None:
    out, series = argv[0], [a.split("=", 1) for a in argv[1:]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = ["-", "--", ":"]
    for (label, path), style in zip(series, styles):
        rows = [r for r in json.load(open(path))["decode"] if r["dql"] == 1 and r["heads"] == 16]
        for i, req in enumerate(sorted({r["requests"] for r in rows})):
            pts = sorted((r["context"] // 1024, r["total_us"]) for r in rows if r["requests"] == req)
            ax.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=f"{req} req, {label}")
    anchors = {1: (13.7, 18.1), 8: (27.3, 72.1), 32: (77.4, 272.5), 128: (305.2, 1225.7)}
    for i, (req, (a32, a128)) in enumerate(anchors.items()):
        ax.plot([32, 128], [a32, a128], "x", color=f"C{i}", markersize=9, label="anchor (same colour)" if i == 0 else None)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([32, 128], ["32k", "128k"])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("index + attend, µs per layer (CUDA graph)")
    ax.set_title("MSA decode on H200, 16/1 heads (x: anchor)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
