"""What no decode-step design goes under on this GPU: the latency of the pieces a decode step is made of (GPU).

    python benchmarks/decode_latency_floor.py [--json PATH] [--streams-only]

A decode step (issue 5) streams a row's index keys from HBM, ranks its block scores once all of them are in, reads
the chosen blocks' pages and then their K / V, and combines the attention's partial results. Each of those
dependencies crosses SMs, so every design pays for it through memory: a kernel boundary, or a barrier across the
grid inside one persistent kernel, and then at least one load of what the other SMs wrote. This script times each
piece alone, as ``bench decode`` times the ops (CUDA graphs replayed, median; inputs rotated out of the L2):

- stream: one launch reading B bytes of HBM with P programs (each layer its own bytes), chained to the next launch
  by dependent launch as the decode kernels are;
- hop: one more kernel in a chain of dependent-launch kernels that each load what the one before stored (released
  after its store, as the decode kernels release), and the same launches unchained;
- grid barrier: one barrier of P programs inside one kernel (an atomic arrival, then polls until all have arrived);
- dependent load: one load whose address is the previous load's value, from HBM and from the L2.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from m3sparse import bench

STREAM_TILE = 2048  # bf16 elements per load of a program: 16 per thread at 4 warps
ROTATED_BYTES = 512 << 20  # a stream's launches read at least this much before one of them comes round again
LAYERS = 64  # kernels per captured graph of a hop chain


@triton.jit
def _stream_kernel(src_ptr, dst_ptr, per_program, TILE: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr):
    """Program p sums elements [p, p + 1) x per_program of src (bf16) into dst[p]; UNROLL independent loads in
    flight per thread before the first add."""
    if PDL:
        gdc_wait()
    base = src_ptr + tl.program_id(0).to(tl.int64) * per_program
    offs = tl.arange(0, TILE)
    acc = tl.zeros([TILE], tl.float32)
    for start in range(0, per_program, TILE * UNROLL):
        for u in tl.static_range(UNROLL):
            acc += tl.load(base + start + u * TILE + offs, cache_modifier=".cg").to(tl.float32)
    tl.store(dst_ptr + tl.program_id(0), tl.sum(acc, axis=0))
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _hop_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
    """dst[p] = src[p] + 1, after the kernel before it (PDL: waited for by dependent launch, the next one released
    after the store)."""
    if PDL:
        gdc_wait()
    p = tl.program_id(0)
    tl.store(dst_ptr + p, tl.load(src_ptr + p) + 1)
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _grid_barrier_kernel(count_ptr, rounds, programs, POLL_ACQUIRE: tl.constexpr):
    """``rounds`` barriers across the grid's ``programs`` programs, all resident: each arrives (a release add),
    then polls the count until every program has arrived (acquire polls, or relaxed ones and one acquire read)."""
    for r in range(rounds):
        tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
        target = (r + 1) * programs
        if POLL_ACQUIRE:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
            while seen < target:
                seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        else:
            seen = tl.atomic_add(count_ptr, 0, sem="relaxed", scope="gpu")
            while seen < target:
                seen = tl.atomic_add(count_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _chase_kernel(next_ptr, at_ptr, steps):
    """steps dependent loads i = next[i] from i = at[0], then at[0] = i: the next launch goes on from there (one
    program; L1 bypassed)."""
    i = tl.load(at_ptr)
    for _ in range(steps):
        i = tl.load(next_ptr + i, cache_modifier=".cg")
    tl.store(at_ptr, i)


def _replay_us(calls, reps: int = 50) -> float:
    """Median µs per call of ``calls`` (a list of zero-argument launches) captured into one CUDA graph and
    replayed ``reps`` times, each replay between two events."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    return bench._events_median(g.replay, reps) / len(calls)


def stream_us(nbytes: int, programs: int) -> float:
    """µs per launch of reading ``nbytes`` fresh from HBM with ``programs`` programs, launches chained."""
    per_program = nbytes // 2 // programs
    unroll = max(1, min(8, per_program // STREAM_TILE))
    if per_program % (STREAM_TILE * unroll) or nbytes % (2 * programs):
        raise ValueError(f"{nbytes} bytes do not split into {programs} programs of whole tiles")
    slices = math.ceil(ROTATED_BYTES / nbytes)
    src = torch.randn(slices * nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty(slices, programs, device="cuda")
    calls = [lambda s=i % slices: _stream_kernel[(programs,)](src[s * (nbytes // 2):], dst[s], per_program,
                                                               TILE=STREAM_TILE, UNROLL=unroll, PDL=True, num_warps=4,
                                                               launch_pdl=True)
             for i in range(max(LAYERS // 4, slices))]
    t = _replay_us(calls)
    # The sums prove every byte was read: each program's sum against torch's.
    want = src.view(slices, programs, per_program).float().sum(-1)
    assert torch.allclose(dst, want, rtol=1e-3, atol=1e-1), "stream kernel read the wrong bytes"
    return t


def hop_us(programs: int, pdl: bool) -> float:
    """µs per kernel of a chain of LAYERS trivial kernels, each loading what the one before stored."""
    bufs = [torch.zeros(programs, dtype=torch.int32, device="cuda") for _ in range(2)]
    calls = [lambda i=i: _hop_kernel[(programs,)](bufs[i % 2], bufs[(i + 1) % 2], PDL=pdl, num_warps=1,
                                                   launch_pdl=pdl)
             for i in range(LAYERS)]
    return _replay_us(calls)


def grid_barrier_us(programs: int, acquire_polls: bool) -> float:
    """µs per barrier across ``programs`` resident programs: the difference of kernels of 33 and 1 rounds."""
    count = torch.zeros(1, dtype=torch.int32, device="cuda")

    def run(rounds):
        count.zero_()
        _grid_barrier_kernel[(programs,)](count, rounds, programs, POLL_ACQUIRE=acquire_polls, num_warps=1)

    t1 = _replay_us([lambda: run(1)] * 8)
    t33 = _replay_us([lambda: run(33)] * 8)
    run(5)
    torch.cuda.synchronize()
    assert count.item() == 5 * programs, f"a barrier round counted {count.item() / 5} arrivals, not {programs}"
    return (t33 - t1) / 32


def dependent_load_us(entries: int, steps: int = 4000) -> float:
    """µs per load of a pointer chase over one random cycle of ``entries`` int32 (L1 bypassed)."""
    order = torch.randperm(entries, device="cuda", dtype=torch.int64)
    nxt = torch.empty(entries, dtype=torch.int32, device="cuda")
    nxt[order] = order.roll(-1).to(torch.int32)
    at = torch.zeros(1, dtype=torch.int32, device="cuda")
    # Every launch goes on along the cycle where the last one stopped, so a timed load never finds a line that an
    # earlier launch brought into the L2 (the first form restarted at 0 and timed 256 MB at the L2's latency).
    # The warm-up walks a cycle that fits the L2 whole, and a few lines of one that does not.
    warm = min(entries, 1 << 16)
    _chase_kernel[(1,)](nxt, at, warm, num_warps=1)
    reps = 7
    t = bench._events_median(lambda: _chase_kernel[(1,)](nxt, at, steps, num_warps=1), reps) / steps
    host, i = nxt.cpu().numpy(), 0
    for _ in range(warm + reps * steps):
        i = int(host[i])
    assert int(at) == i, "the chase did not follow its cycle"
    return t


# (label, bytes, programs): the index-key and K / V streams of the anchor cases' decode steps.
STREAMS = [
    ("1 x 32k index keys (bf16)", 256 * 32768, 128), ("1 x 32k index keys (bf16)", 256 * 32768, 256),
    ("1 x 32k index keys (bf16)", 256 * 32768, 512), ("1 x 32k index keys (bf16)", 256 * 32768, 1024),
    ("1 x 32k index keys (bf16)", 256 * 32768, 2048),
    ("1 x 128k index keys (bf16)", 256 * 131072, 256), ("1 x 128k index keys (bf16)", 256 * 131072, 512),
    ("1 x 128k index keys (bf16)", 256 * 131072, 1024),
    ("8 x 32k index keys (bf16)", 8 * 256 * 32768, 512), ("8 x 32k index keys (bf16)", 8 * 256 * 32768, 2048),
    ("8 x 128k index keys (bf16)", 8 * 256 * 131072, 512),
    ("1 row's 16 blocks of K / V", 16 * 65536, 16), ("1 row's 16 blocks of K / V", 16 * 65536, 32),
    ("1 row's 16 blocks of K / V", 16 * 65536, 64), ("1 row's 16 blocks of K / V", 16 * 65536, 128),
    ("8 rows' K / V", 8 * 16 * 65536, 128),
    ("32 rows' K / V", 32 * 16 * 65536, 128), ("32 rows' K / V", 32 * 16 * 65536, 256),
    ("32 rows' K / V", 32 * 16 * 65536, 512), ("32 rows' K / V", 32 * 16 * 65536, 1024),
    ("32 rows' K / V", 32 * 16 * 65536, 2048), ("32 rows' K / V", 32 * 16 * 65536, 4096),
    ("32 rows' K / V", 32 * 16 * 65536, 8192),
    ("32 rows' K / V, one program per row", 32 * 16 * 65536, 32),
]


def latency_rows() -> list[dict]:
    """The hops, grid barriers and dependent loads, one row each."""
    rows = []
    for programs in (1, 132):
        for pdl in (True, False):
            rows.append(dict(piece="hop", what=f"{programs} programs, {'dependent launch' if pdl else 'plain'}",
                             programs=programs, us=hop_us(programs, pdl)))
    for programs in (132, 264):
        for acquire in (True, False):
            rows.append(dict(piece="grid barrier", what=f"{programs} programs, {'acquire' if acquire else 'relaxed'}"
                             " polls", programs=programs, us=grid_barrier_us(programs, acquire)))
    for entries, where in ((1 << 14, "L2 (64 KB cycle)"), (1 << 26, "HBM (256 MB cycle)")):
        rows.append(dict(piece="dependent load", what=where, entries=entries, us=dependent_load_us(entries)))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--streams-only", action="store_true", help="time the streams, not the other pieces")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    props = torch.cuda.get_device_properties(0)
    print(f"GPU {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}")
    bench._warm_up_gpu()
    rows = []
    for label, nbytes, programs in STREAMS:
        t = stream_us(nbytes, programs)
        rows.append(dict(piece="stream", what=label, bytes=nbytes, programs=programs, us=t,
                         tb_per_s=nbytes / t / 1e6))
        torch.cuda.empty_cache()
    if not args.streams_only:
        rows += latency_rows()
    print("| piece | what | programs | µs | TB/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        tb = f"{r['tb_per_s']:.2f}" if "tb_per_s" in r else "—"
        print(f"| {r['piece']} | {r['what']} | {r.get('programs', 1)} | {r['us']:.2f} | {tb} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=props.name, torch=torch.__version__, triton=triton.__version__, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
