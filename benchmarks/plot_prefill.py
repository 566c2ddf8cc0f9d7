"""Plot prefill attention throughput and total time per selection pattern from a `bench --json` file.

usage: python benchmarks/plot_prefill.py OUT.png bench.json
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _label(r: dict) -> str:
    tokens = f"{r['requests']}×{r['tokens'] // 1024}k" if r["requests"] > 1 else f"{r['tokens'] // 1024}k"
    prefix = f" on {r['prefix'] // 1024}k" if r["prefix"] else ""
    return f"{tokens}{prefix}\n{r['heads']}/{r['kv_heads']}"


def main(argv: list[str]) -> None:
    out, path = argv
    rows = json.load(open(path))["prefill"]
    patterns = list(dict.fromkeys(r["pattern"] for r in rows))
    cases = list(dict.fromkeys(_label(r) for r in rows))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    width = 0.8 / len(patterns)
    for k, pattern in enumerate(patterns):
        by_case = {_label(r): r for r in rows if r["pattern"] == pattern}
        xs = [i + (k - (len(patterns) - 1) / 2) * width for i, c in enumerate(cases) if c in by_case]
        top.bar(xs, [by_case[c]["attend_tflops"] for c in cases if c in by_case], width, label=pattern)
        bottom.bar(xs, [by_case[c]["index_ms"] + by_case[c]["attend_ms"] for c in cases if c in by_case], width,
                   label=pattern)
    top.axhline(120, color="k", ls=":", lw=1, label="anchor attend (~120)")
    top.axhline(400, color="r", ls="--", lw=1, label="issue target (400)")
    top.set_ylabel("attend, useful TFLOP/s")
    top.legend(fontsize=7, ncol=5)
    dense = {_label(r): r["dense_ms"] for r in rows if r["dense_ms"]}
    anchor = {_label(r): r["anchor_index_ms"] + r["anchor_attend_ms"] for r in rows if r["anchor_index_ms"]}
    for i, c in enumerate(cases):
        if c in dense:
            bottom.plot([i - 0.4, i + 0.4], [dense[c]] * 2, "k-", lw=1.5, label="dense SDPA flash" if i == 0 else None)
        if c in anchor:
            bottom.plot([i - 0.4, i + 0.4], [anchor[c]] * 2, "k:", lw=1.5, label="anchor total" if i == 0 else None)
    bottom.set_yscale("log")
    bottom.set_ylabel("index + attend, ms")
    bottom.set_xticks(range(len(cases)), cases, fontsize=8)
    bottom.legend(fontsize=7, ncol=5)
    fig.suptitle("MSA prefill on H200 by selection pattern (one layer, eager)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
