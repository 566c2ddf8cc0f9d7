"""Plot decode total µs against context from `python -m m3sparse bench --json` files: one panel per head shape, one
colour per batch size, one line style per (file label, query tokens per request); the anchors (``bench.DECODE_ANCHORS``)
on their head shape's panel.

usage: python benchmarks/plot_decode.py OUT.png LABEL=bench.json [LABEL=bench.json ...]
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from m3sparse.bench import DECODE_ANCHORS  # noqa: E402


def _context_label(kib: int) -> str:
    return f"{kib // 1024}M" if kib >= 1024 else f"{kib}k"


def main(argv: list[str]) -> None:
    out, series = argv[0], [a.split("=", 1) for a in argv[1:]]
    rows = [(label, r) for label, path in series for r in json.load(open(path))["decode"]]
    shapes = sorted({(r["heads"], r["kv_heads"]) for _, r in rows}, key=lambda s: (s != (16, 1), s))
    lines = sorted({(label, r["dql"]) for label, r in rows}, key=lambda x: ([s[0] for s in series].index(x[0]), x[1]))
    styles = dict(zip(lines, ["-", "--", ":", "-."] * 4))
    batches = sorted({r["requests"] for _, r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, (heads, kv_heads) in zip(axes[0], shapes):
        contexts = set()
        for (label, dql), style in styles.items():
            for i, req in enumerate(batches):
                case = (label, dql, req, heads, kv_heads)
                pts = sorted((r["context"] // 1024, r["total_us"]) for lab, r in rows
                             if (lab, r["dql"], r["requests"], r["heads"], r["kv_heads"]) == case)
                if pts:
                    contexts.update(c for c, _ in pts)
                    ax.plot(*zip(*pts), style, marker="o", color=f"C{i}", label=f"{req} req, {dql} q, {label}")
        labelled = False
        for (req, context, dql, h, kv), (index_us, attend_us) in DECODE_ANCHORS.items():
            if (dql, h, kv) == (1, heads, kv_heads) and req in batches:
                ax.plot(context // 1024, index_us + attend_us, "x", color=f"C{batches.index(req)}", markersize=9,
                        label=None if labelled else "anchor, 1 q (colour: requests)")
                labelled = True
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted(contexts)
        ax.set_xticks(ticks, [_context_label(c) for c in ticks])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("index + attend, µs per layer (CUDA graph)")
        ax.set_title(f"MSA decode on H200, {heads}/{kv_heads} heads")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
