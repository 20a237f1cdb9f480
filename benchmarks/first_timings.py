"""First single-sequence timings on a GPU at real shapes (bf16), against HF transformers.

  here:        python benchmarks/first_timings.py build DIR [--shape 4b]
  on the GPU:  python benchmarks/first_timings.py run DIR WORK [--shape 4b]

TTFT of a 1,024-token prompt, bs1 decode TPOT over 256 greedy steps, the device-to-device copy
bandwidth of the same run and the roofline TPOT = bytes of weights read per token / that
bandwidth; then HF transformers (bf16, same GPU, same weights) for comparison.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

PROMPT, STEPS = 1024, 256


def build(out: Path, shape: str) -> None:
    from common import build_library

    seconds = build_library(shape, "bfloat16", out / f"{shape}-bfloat16")
    (out / f"{shape}-build.json").write_text(json.dumps({"compile_seconds": seconds}))
    print(f"{shape} bf16 library compiled in {seconds:.1f} s")


def _weight_bytes_per_token(artifact) -> int:
    """Every parameter is read once per decode step, except the embedding table, of which
    one row is read, unless it is tied, when the logits kernel reads `selection` rows of it."""
    total = 0
    for p in artifact.meta["params"]:
        n = int(np.prod(p["shape"])) * (2 if p["dtype"] == "bfloat16" else 4)
        if p["name"] == "embed_tokens.weight":
            n = (
                n
                // p["shape"][0]
                * (artifact.widths.selection if artifact.config["tie_word_embeddings"] else 1)
            )
        elif p["name"] == "lm_head.weight":
            n = n // p["shape"][0] * artifact.widths.selection
        total += n
    return total


def run(libs: Path, work: Path, shape: str) -> dict:
    import torch
    from common import copy_bandwidth
    from transformers import Qwen3_5ForCausalLM

    from qwen35_tvm.compile.convert import convert_weights
    from qwen35_tvm.compile.random_model import SHAPES, write_random_model
    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.generate import Generator
    from qwen35_tvm.runtime.sampler import SamplingParams

    t0 = time.time()
    hf_dir = write_random_model(SHAPES[shape], work / f"hf-{shape}", dtype="bfloat16")
    art_dir = work / f"art-{shape}"
    shutil.copytree(libs / f"{shape}-bfloat16", art_dir, dirs_exist_ok=True)
    convert_weights(hf_dir, art_dir)
    print(f"weights written and converted in {time.time() - t0:.0f} s", flush=True)
    bw = copy_bandwidth(torch)
    artifact = Artifact(art_dir, device="cuda")
    gen = Generator(artifact, prefill_chunk=2048)
    prompt = np.random.default_rng(0).integers(0, gen.decodable, size=PROMPT).tolist()
    greedy = SamplingParams(temperature=0.0)

    def ours_ttft() -> float:
        start = time.perf_counter()
        next(gen.generate(prompt, greedy, 1, stop_ids=[]))
        return time.perf_counter() - start

    ours_ttft()  # warm-up: first calls load kernels
    ttft = min(ours_ttft() for _ in range(3))
    stamps = []
    start = time.perf_counter()
    for _ in gen.generate(prompt, greedy, STEPS + 1, stop_ids=[]):
        stamps.append(time.perf_counter())
    tpot = (stamps[-1] - stamps[0]) / STEPS
    weight_bytes = _weight_bytes_per_token(artifact)
    roofline = weight_bytes / (bw / 2)  # copy bandwidth counts bytes read + written
    ours = dict(ttft_ms=ttft * 1e3, tpot_ms=tpot * 1e3)
    gen.runner = artifact.params = None  # free the device memory before HF loads its copy
    torch.cuda.empty_cache()

    hf = Qwen3_5ForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        hf(ids)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, do_sample=False)
        torch.cuda.synchronize()
        hf_ttft = time.perf_counter() - start
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=STEPS + 1, min_new_tokens=STEPS + 1, do_sample=False)
        torch.cuda.synchronize()
        hf_tpot = (time.perf_counter() - start - hf_ttft) / STEPS
    result = dict(
        shape=shape,
        device=torch.cuda.get_device_name(),
        copy_bw_tbs=bw / 1e12,
        weight_gb_per_token=weight_bytes / 1e9,
        roofline_tpot_ms=roofline * 1e3,
        ours=ours,
        hf=dict(ttft_ms=hf_ttft * 1e3, tpot_ms=hf_tpot * 1e3),
        ours_tpot_over_roofline=tpot / roofline,
    )
    print(json.dumps(result, indent=2))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("step", choices=["build", "run"])
    p.add_argument("dir", type=Path)
    p.add_argument("work", type=Path, nargs="?", default=Path("/tmp/qwen35-timings"))
    p.add_argument("--shape", default="4b")
    args = p.parse_args()
    if args.step == "build":
        build(args.dir, args.shape)
    else:
        args.work.mkdir(parents=True, exist_ok=True)
        out = run(args.dir, args.work, args.shape)
        (args.work / "timings.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
