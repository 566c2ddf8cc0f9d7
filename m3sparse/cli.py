"""python -m m3sparse {demo, bench, check}."""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch


def _check() -> int:
    import m3sparse

    print(f"m3sparse   {m3sparse.__version__}")
    print(f"python     {platform.python_version()} ({platform.machine()})")
    print(f"torch      {torch.__version__}")
    try:
        import triton
        print(f"triton     {triton.__version__}")
    except ImportError:
        print("triton     not installed")
    print(f"interpreter TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"gpu {i}      {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                  f"{p.total_memory / 2**30:.0f} GiB")
    else:
        print("gpu        none (CPU tensors run the reference)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m m3sparse", description="MiniMax-M3 sparse attention")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="an MSA layer over a mixed batch, checked against dense attention")
    demo.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    demo.add_argument("--kv-cache-dtype", default="bfloat16", choices=["bfloat16", "float16", "fp8_e4m3", "fp8_e5m2"])
    demo.add_argument("--layout", default="HND", choices=["HND", "NHD"])
    demo.add_argument("--num-heads", type=int, default=16)
    demo.add_argument("--num-kv-heads", type=int, default=1)
    demo.add_argument("--seed", type=int, default=0)
    sub.add_parser("check", help="print the environment")
    sub.add_parser("bench", help="GPU kernel timings at the anchor shapes (options: python -m m3sparse bench -h)",
                   add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "check":
        return _check()
    if args.command == "bench":
        from .bench import main as bench_main
        bench_main(rest)
        return 0
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; none is visible")
    from .demo import run_demo
    return run_demo(args.device, args.kv_cache_dtype, args.layout, args.num_heads, args.num_kv_heads, args.seed)


if __name__ == "__main__":
    sys.exit(main())
