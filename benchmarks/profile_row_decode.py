"""Nsight Compute profile of the per-row decode launch in several pipeline shapes (GPU; issue 5, criterion 4).

    python benchmarks/profile_row_decode.py [--shapes 1:128:3,2:64:3] [--ids shared] [--case 32:131072:4]
        [--out DIR]

Each shape is splits:keys per chunk:stages, forced on ``_row_pipeline`` (by default the launch rule picks them).
For each, ncu profiles one ``_sparse_attn_kernel`` launch of the case requests:context:rows (by default
32 requests x 128k x 4 speculative rows, criterion 4's), 16/1 heads, whose rows share 12 of their 16 blocks with
their request's first row ("shared") or not ("ids"), and prints the duration, the L1 / shared-memory pipe's and
the L2's throughput, the shared-memory wavefronts and bank conflicts, issue activity, and the warp stalls per
issued instruction. The whole ncu report of each shape goes to DIR. Why: v12, v35 and v68 found that a second
program per SM leaves the shared case's time unchanged, and none measured why (answered in docs/perf-notes.md v70).

``--launch SPLITS CHUNK STAGES IDS CASE`` runs the launches ncu profiles (three layers; ncu takes the third).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

STALLS = ("wait", "short_scoreboard", "long_scoreboard", "barrier", "mio_throttle", "lg_throttle",
          "math_pipe_throttle", "selected", "not_selected", "dispatch_stall", "no_instruction", "branch_resolving",
          "drain", "membar", "misc")
METRICS = ("gpu__time_duration.sum", "sm__cycles_elapsed.avg", "smsp__inst_executed.sum",
           "smsp__issue_active.avg.pct_of_peak_sustained_active", "sm__warps_active.avg.per_cycle_active",
           "l1tex__throughput.avg.pct_of_peak_sustained_elapsed",
           "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
           "lts__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum",
           *(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS))


def launch(splits: int, chunk: int, stages: int, ids: str, case: str) -> None:
    import torch
    sys.path.insert(0, os.path.dirname(__file__))
    import spec_decode_forms as forms
    from m3sparse import bench
    import m3sparse.kernels.sparse_attn as SA
    SA._row_pipeline = lambda *args, **kwargs: (chunk, stages)
    gen = torch.Generator(device="cuda").manual_seed(0)
    requests, context, rows = (int(x) for x in case.split(":"))
    layers, seq_lens, kv, _ = forms._layers(requests, context, rows, 16, 1, gen)
    for s in layers[:3]:
        SA.sparse_attn_decode(s["q"], kv, s[ids], s["table"], seq_lens, rows, bench.D ** -0.5, s["out"], None, None,
                              rows_together=False, splits=splits)
    torch.cuda.synchronize()


def profile(shape: str, ids: str, case: str, out: str) -> None:
    splits, chunk, stages = shape.split(":")
    report = os.path.join(out, f"ncu-{case.replace(':', 'x')}-{ids}-{splits}-{chunk}-{stages}.txt")
    cmd = ["ncu", "--kernel-name", "regex:_sparse_attn_kernel", "--launch-skip", "2", "--launch-count", "1",
           "--section", "SpeedOfLight", "--section", "Occupancy", "--metrics", ",".join(METRICS),
           sys.executable, __file__, "--launch", splits, chunk, stages, ids, case]
    with open(report, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=120).returncode
    print(f"== {case} {ids}, {splits} splits of {chunk}-key chunks x {stages} stages: ncu exit {rc}", flush=True)
    lines = [line.split() for line in pathlib.Path(report).read_text().splitlines()]
    # A failed run: the report's tail says why. Otherwise the metrics asked for and the sections' headline rows.
    shown = lines[-8:] if rc else [w for w in lines if w and (w[0] in METRICS or w[0] == "Duration"
                                                               or w[:2] == ["Achieved", "Occupancy"])]
    for words in shown:
        print("  " + " ".join(words))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1:128:3,2:64:3")
    ap.add_argument("--ids", default="shared", choices=("shared", "ids"))
    ap.add_argument("--case", default="32:131072:4", help="requests:context:rows per request")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--launch", nargs=5, metavar=("SPLITS", "CHUNK", "STAGES", "IDS", "CASE"))
    args = ap.parse_args(argv)
    if args.launch:
        splits, chunk, stages, ids, case = args.launch
        launch(int(splits), int(chunk), int(stages), ids, case)
        return
    os.makedirs(args.out, exist_ok=True)
    for shape in args.shapes.split(","):
        profile(shape, args.ids, args.case, args.out)


if __name__ == "__main__":
    main()
