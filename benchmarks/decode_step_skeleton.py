"""A decode step with its memory traffic and its dependencies and no arithmetic: what the step's shape costs (GPU).

    python benchmarks/decode_step_skeleton.py [--json PATH] [--cases 1x32k,8x128k:e4m3,...]

Issue 5's small-batch targets are latency, not bandwidth. This script builds the step that every design of MSA
decode has to run, with the work removed and the dependencies kept, and times it as ``bench decode`` times the ops
(a 16-layer CUDA graph replayed, median of 50, each layer its own pages so nothing is served by the L2):

1. scores: row r's index keys, one 128 x 128 page per block found through the row's block table, each block
   reduced to its largest element (a max, where the real scorer takes dots and then a max);
2. selection: once all of a row's block scores are in, 16 distinct block ids derived from their sum (the real
   selection's data dependency without its compare-exchange work);
3. attention: each split loads its ids, then their pages, then streams those blocks' K and V (64 KB a block) and
   writes a per-dimension sum (the real kernel's partial);
4. merge: each row sums its splits' partials.

The four kernels chain by programmatic dependent launch, released after their last store, as the decode ops do.
Each case sweeps the scoring grid and the attention's splits and reports the fastest. This is not a proven lower
bound: it is the step's traffic and dependencies written the plain way, so a design with the same dependencies
goes under it only by moving its bytes or hiding its waits better than this form does. A design that merges two
of the kernels still pays a barrier across the grid, which decode_latency_floor.py times at about a dependent
launch's hop. The last layer's ids and output are checked against torch, so an unread or misread page fails.
It also times the attention and merge alone on 32 x 128k x 4 speculative rows (issue 5's criterion 4), where the
ops' pipelined per-row kernel beats this plain form.
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

from decode_latency_floor import _replay_us
from m3sparse import bench
from m3sparse.kernels.dependent_launch import chained_launch, release_consumer, wait_for_producer

BLOCK, DIM, TOPK, LAYERS = 128, 128, 16, 16
PAGE = BLOCK * DIM  # elements of one block's index keys, and of its K (then its V)
KV_POOL_BYTES = 2 << 30  # K / V pages a case's block tables point into at random: far past the 60 MB L2


@triton.jit
def _skeleton_scores_kernel(ik_ptr, bt_ptr, sc_ptr, NB, per_program, PAGE_ELEMS: tl.constexpr, PDL: tl.constexpr):
    """Program (r, s) reads blocks [s, s + 1) x per_program of row r (page from bt[r, block]) and writes each
    block's largest element to sc[r, block] (int32)."""
    wait_for_producer(PDL)
    r = tl.program_id(0)
    offs = tl.arange(0, PAGE_ELEMS)
    for i in range(per_program):
        kb = tl.program_id(1) * per_program + i
        page = tl.load(bt_ptr + r * NB + kb).to(tl.int64)
        keys = tl.load(ik_ptr + page * PAGE_ELEMS + offs, cache_modifier=".cg")
        tl.store(sc_ptr + r * NB + kb, tl.max(keys.to(tl.int32), axis=0))
    release_consumer(PDL)


@triton.jit
def _skeleton_select_kernel(sc_ptr, ids_ptr, NB, NB_PAD: tl.constexpr, TOPK_: tl.constexpr, PDL: tl.constexpr):
    """Row r's TOPK_ distinct ids: id j = j x (NB / TOPK_) + (sum of the row's scores) mod (NB / TOPK_)."""
    wait_for_producer(PDL)
    r = tl.program_id(0)
    b = tl.arange(0, NB_PAD)
    total = tl.sum(tl.load(sc_ptr + r * NB + b, mask=b < NB, other=0), axis=0)
    stride = NB // TOPK_
    j = tl.arange(0, TOPK_)
    tl.store(ids_ptr + r * TOPK_ + j, j * stride + (total & 0x7FFFFFFF) % stride)
    release_consumer(PDL)


@triton.jit
def _skeleton_attend_kernel(kv_ptr, bt_ptr, ids_ptr, part_ptr, NB, SPLITS: tl.constexpr, BLOCKS: tl.constexpr,
                            PARTS: tl.constexpr, TOPK_: tl.constexpr, PAGE_ELEMS: tl.constexpr,
                            D: tl.constexpr, PDL: tl.constexpr):
    """Program (r, s) sums K and V over its share of row r's blocks (BLOCKS whole ones, or token part s % PARTS
    of one) into part[r, s, :] (fp32). A K / V page holds the block's K, then its V."""
    wait_for_producer(PDL)
    r = tl.program_id(0)
    s = tl.program_id(1)
    TOKENS: tl.constexpr = PAGE_ELEMS // D // PARTS
    t = (s % PARTS) * TOKENS + tl.arange(0, TOKENS)
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    for i in range(BLOCKS):
        block = tl.load(ids_ptr + r * TOPK_ + (s // PARTS) * BLOCKS + i)
        page = tl.load(bt_ptr + r * NB + block).to(tl.int64)
        k_at = kv_ptr + page * (2 * PAGE_ELEMS) + t[:, None] * D + d[None, :]
        k = tl.load(k_at, cache_modifier=".cg")
        v = tl.load(k_at + PAGE_ELEMS, cache_modifier=".cg")
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), axis=0)
    tl.store(part_ptr + (r * SPLITS + s) * D + d, acc)
    release_consumer(PDL)


@triton.jit
def _skeleton_merge_kernel(part_ptr, out_ptr, SPLITS: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr):
    wait_for_producer(PDL)
    r = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    parts = tl.load(part_ptr + (r * SPLITS + s)[:, None] * D + d[None, :])
    tl.store(out_ptr + r * D + d, tl.sum(parts, axis=0))
    release_consumer(PDL)


class Step:
    """One case's inputs: ``layers`` layers of ``rows`` rows at ``context`` tokens, index keys of ``index_bytes``
    bytes per element (0: none, for the attention alone), each layer its own index pages and its own random K / V
    pages of a pool of ``kv_pool_bytes``."""

    def __init__(self, rows: int, context: int, index_bytes: int, gen: torch.Generator, layers: int = LAYERS,
                 kv_pool_bytes: int = KV_POOL_BYTES):
        dev = gen.device
        self.rows, self.nb, self.layers, self.pdl = rows, context // BLOCK, layers, chained_launch(dev)
        if index_bytes:
            pages = layers * rows * self.nb
            dtype = torch.int16 if index_bytes == 2 else torch.uint8
            info = torch.iinfo(dtype)
            self.index = torch.randint(info.min, info.max, (pages, PAGE), dtype=dtype, device=dev, generator=gen)
            self.index_table = torch.randperm(pages, device=dev, generator=gen).to(torch.int32).view(
                layers, rows, self.nb)
        kv_pages = kv_pool_bytes // (2 * PAGE * 2)
        self.kv = torch.randn(kv_pages, 2 * PAGE, dtype=torch.bfloat16, device=dev, generator=gen)
        self.kv_table = torch.randint(0, kv_pages, (layers, rows, self.nb), dtype=torch.int32, device=dev,
                                      generator=gen)
        self.scores = torch.empty(layers, rows, self.nb, dtype=torch.int32, device=dev)
        self.ids = torch.empty(layers, rows, TOPK, dtype=torch.int32, device=dev)
        self.out = torch.empty(layers, rows, DIM, device=dev)

    def calls(self, score_programs: int | None, splits: int) -> list:
        """The step's launches for every layer (score_programs None: the attention and merge alone, on ids the
        full step wrote)."""
        parts, blocks = max(1, splits // TOPK), max(1, TOPK // splits)
        partials = torch.empty(self.layers, self.rows, splits, DIM, device=self.out.device)
        pdl, out = self.pdl, []
        for layer in range(self.layers):
            if score_programs is not None:
                per_row = score_programs // self.rows
                out.append(lambda l=layer, p=per_row: _skeleton_scores_kernel[(self.rows, p)](
                    self.index, self.index_table[l], self.scores[l], self.nb, self.nb // p, PAGE_ELEMS=PAGE,
                    PDL=pdl, num_warps=4, launch_pdl=pdl > 0))
                out.append(lambda l=layer: _skeleton_select_kernel[(self.rows,)](
                    self.scores[l], self.ids[l], self.nb, NB_PAD=triton.next_power_of_2(self.nb), TOPK_=TOPK,
                    PDL=pdl, num_warps=4, launch_pdl=pdl > 0))
            out.append(lambda l=layer: _skeleton_attend_kernel[(self.rows, splits)](
                self.kv, self.kv_table[l], self.ids[l], partials[l], self.nb, SPLITS=splits, BLOCKS=blocks,
                PARTS=parts, TOPK_=TOPK, PAGE_ELEMS=PAGE, D=DIM, PDL=pdl, num_warps=8 if parts == 1 else 4,
                launch_pdl=pdl > 0))
            out.append(lambda l=layer: _skeleton_merge_kernel[(self.rows,)](
                partials[l], self.out[l], SPLITS=splits, D=DIM, PDL=pdl, num_warps=4, launch_pdl=pdl > 0))
        return out

    def check(self, layer: int) -> None:
        """The layer's ids and output against torch: every index page, the ids' pages and their K / V read."""
        pages = self.index_table[layer].long()
        scores = self.index[pages].to(torch.int32).amax(-1)
        total = scores.sum(-1) & 0x7FFFFFFF
        stride = self.nb // TOPK
        ids = torch.arange(TOPK, device=total.device) * stride + (total % stride)[:, None]
        assert torch.equal(self.ids[layer].long(), ids), "the skeleton selected other blocks"
        self.check_attention(layer)

    def check_attention(self, layer: int) -> None:
        """The layer's output against torch on the layer's ids."""
        kv = self.kv[self.kv_table[layer].gather(1, self.ids[layer].long()).long()].float()  # [rows, TOPK, 2 PAGE]
        want = kv.view(self.rows, TOPK, 2, BLOCK, DIM).sum((1, 2, 3))
        assert torch.allclose(self.out[layer], want, rtol=1e-3, atol=1e-2), "the skeleton read the wrong K / V"


def _programs(rows: int, nb: int) -> list[int]:
    """Scoring grids of 256-2048 programs whose rows split their blocks evenly."""
    return [p for p in (256, 512, 1024, 2048) if p % rows == 0 and nb % (p // rows) == 0 and p // rows <= nb]


def run_case(rows: int, context: int, index_bytes: int, gen: torch.Generator) -> dict:
    step = Step(rows, context, index_bytes, gen)
    splits_grid = (4, 8, 16, 32) if rows >= 32 else (8, 16, 32, 64)
    best = None
    for programs, splits in itertools.product(_programs(rows, step.nb), splits_grid):
        t = _replay_us(step.calls(programs, splits)) * 4  # _replay_us divides by the 4 launches per layer
        step.check(step.layers - 1)
        if best is None or t < best["step_us"]:
            best = dict(step_us=t, score_programs=programs, splits=splits)
    # Scores and selection alone: the first two of each layer's four launches.
    index_only = min(_replay_us([c for i, c in enumerate(step.calls(p, 16)) if i % 4 < 2]) * 2
                     for p in _programs(rows, step.nb))
    attend_only = {s: _replay_us(step.calls(None, s)) * 2 for s in splits_grid}
    s_best = min(attend_only, key=attend_only.get)
    del step
    torch.cuda.empty_cache()
    return dict(rows=rows, context=context, index_bytes=index_bytes, index_us=index_only,
                attend_us=attend_only[s_best], attend_splits=s_best, **best)


def run_speculative_case(requests: int, context: int, dql: int, gen: torch.Generator) -> dict:
    """Issue 5's criterion 4: attention and merge alone over requests x dql rows, each request's rows on one block
    table, with bench decode's ids (rows sharing 12 of their 16 blocks with the request's first row) and with
    independent rows."""
    rows = requests * dql
    step = Step(rows, context, 0, gen)
    step.kv_table.copy_(step.kv_table[:, ::dql].repeat_interleave(dql, dim=1))
    seq_lens = torch.full((requests,), context, dtype=torch.int32, device=gen.device)
    result = dict(rows=rows, context=context, dql=dql)
    for name in ("shared", "independent"):
        for layer in range(step.layers):
            ids = bench._realistic_ids(seq_lens, dql, 1, gen)
            step.ids[layer] = (bench._shared_ids(ids, dql) if name == "shared" else ids)[0]
        times = {s: _replay_us(step.calls(None, s)) * 2 for s in (1, 2, 4, 8, 16)}
        step.check_attention(step.layers - 1)
        best = min(times, key=times.get)
        result[name + "_attend_us"], result[name + "_splits"] = times[best], best
    return result


# Issue 5's missed cases: (rows, context, bytes per index-key element).
CASES = [(1, 32768, 2), (1, 131072, 2), (8, 32768, 2), (8, 131072, 2), (32, 32768, 2),
         (8, 32768, 1), (8, 131072, 1), (32, 32768, 1)]


def _parse_cases(text: str) -> list[tuple[int, int, int]]:
    """'8x128k,8x128k:e4m3' -> [(8, 131072, 2), (8, 131072, 1)]."""
    out = []
    for item in filter(None, text.split(",")):
        shape, _, keys = item.lower().partition(":")
        rows, ctx = shape.split("x")
        out.append((int(rows), int(ctx.rstrip("k")) * 1024, 1 if keys == "e4m3" else 2))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--cases", type=_parse_cases, default=CASES,
                        help="rows x context[:e4m3], e.g. 1x32k,8x128k:e4m3 (none: '')")
    parser.add_argument("--no-speculative", dest="speculative", action="store_false",
                        help="skip 32 x 128k x 4 speculative rows (issue 5's criterion 4)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    bench._warm_up_gpu()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = [run_case(r, c, b, gen) for r, c, b in args.cases]
    speculative = run_speculative_case(32, 131072, 4, gen) if args.speculative else None
    print("| rows | context | index keys | skeleton step µs (programs, splits) | scores + selection µs "
          "| attention + merge µs (splits) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['context'] // 1024}k | {'bf16' if r['index_bytes'] == 2 else 'e4m3'} "
              f"| {r['step_us']:.2f} ({r['score_programs']}, {r['splits']}) | {r['index_us']:.2f} "
              f"| {r['attend_us']:.2f} ({r['attend_splits']}) |")
    if speculative:
        print(f"32 x 128k x 4 rows, attention + merge µs (splits): rows sharing 12/16 "
              f"{speculative['shared_attend_us']:.2f} ({speculative['shared_splits']}), independent rows "
              f"{speculative['independent_attend_us']:.2f} ({speculative['independent_splits']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows, speculative=speculative), f, indent=1)


if __name__ == "__main__":
    main()
