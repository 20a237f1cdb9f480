"""Kernel launches per call of `decode`, `prefill` and (where built) `prefill_prompts` in a CUDA
build, counted without a GPU.

The model is lowered with the CUDA Relax pipeline (CUDA graphs off, so every launch stays in the
function itself); each PrimFunc call is then worth as many kernels as the PrimFunc has
outermost thread-bound loops (each becomes its own __global__ after SplitHostDevice). Library
calls other than our PrimFuncs (cuBLAS and the like) count one each. Usage:

    python benchmarks/count_kernels.py --shape 4b --dtype bfloat16 [--by-kernel]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import tvm
from tvm import tirx


def kernels_in(func: tirx.PrimFunc) -> int:
    """Outermost thread-bound loops (or launch_thread scopes) of a scheduled PrimFunc, read off
    its script by indentation: TVM 0.27 has no Python statement visitor for tirx."""
    count, root = 0, None
    for line in func.script().splitlines():
        indent = len(line) - len(line.lstrip())
        if root is not None and line.strip() and indent <= root:
            root = None
        if root is None and re.search(r"T\.thread_binding\(|T\.launch_thread\(", line):
            count, root = count + 1, indent
    return count


def launches(mod: tvm.IRModule, fn: str) -> Counter:
    """{callee: kernel launches} for one call of Relax function `fn`."""
    prims = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
    text = mod[fn].script()
    found: Counter = Counter()
    for name in re.findall(r"^ +(?:\w+(?::[^=]*)? = )?(?:cls\.)?(\w+)\(", text, re.M):
        if name in prims and kernels_in(prims[name]):
            found[name] += kernels_in(prims[name])
    for name in re.findall(r'call_packed\("([\w.]*(?:cublas|cudnn|thrust)[\w.]*)"', text):
        found[name] += 1
    return found


def lowered(shape: str, dtype: str) -> tvm.IRModule:
    from qwen35_tvm.compile.build import build_module
    from qwen35_tvm.compile.config import ModelConfig
    from qwen35_tvm.compile.pipeline import relax_pipeline
    from qwen35_tvm.compile.random_model import SHAPES
    from qwen35_tvm.compile.targets import make_target
    from qwen35_tvm.compile.vocab import VocabWidths

    cfg = ModelConfig.from_hf(SHAPES[shape])
    widths = VocabWidths.resolve(cfg.vocab_size, 248077)
    target, _ = make_target("cuda", "sm_90")
    mod, _ = build_module(cfg, widths, dtype, target)
    with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": False}):
        return relax_pipeline(target)(mod)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="tiny")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--by-kernel", action="store_true")
    args = p.parse_args()
    mod = lowered(args.shape, args.dtype)
    names = {gv.name_hint for gv, _ in mod.functions_items()}
    for fn in [f for f in ("decode", "decode_wide", "prefill", "prefill_prompts") if f in names]:
        found = launches(mod, fn)
        print(f"{fn}: {sum(found.values())} kernel launches, {len(found)} distinct PrimFuncs")
        if args.by_kernel:
            for name, n in found.most_common():
                print(f"  {n:4d}  {name}")


if __name__ == "__main__":
    main()
