"""`qwen35-tvm`: one command, a subcommand per job.

Each subcommand imports only its own side: the runtime commands never load the compiler.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _compile(args: argparse.Namespace) -> None:
    from qwen35_tvm.compile.build import compile_model

    out = compile_model(
        args.model,
        args.output,
        target=args.target,
        arch=args.arch,
        dtype=args.dtype,
        context_window=args.context_window,
        convert=not args.no_convert,
        cuda_graph=not args.no_cuda_graph,
        dependent_launch=not args.no_dependent_launch,
    )
    print(f"artifact written to {out}")


def _convert(args: argparse.Namespace) -> None:
    from qwen35_tvm.compile.convert import convert_weights

    convert_weights(args.model, args.artifact)


def _pack(args: argparse.Namespace) -> None:
    from qwen35_tvm.compile.pack import pack

    bundle = pack(
        args.artifact,
        args.output,
        python=args.python,
        weights=not args.no_weights,
        archive=args.zip,
        glibc=args.glibc,
        extra_requirements=args.extra,
        cache_dir=args.cache_dir,
        force=args.force,
    )
    print(f"bundle written to {bundle.path}" + (f" and {bundle.archive}" if bundle.archive else ""))


def _random_model(args: argparse.Namespace) -> None:
    from qwen35_tvm.compile.random_model import SHAPES, write_random_model

    out = write_random_model(
        SHAPES[args.shape], Path(args.output), seed=args.seed, dtype=args.dtype
    )
    print(f"random {args.shape} model written to {out}")


def _sampling(args: argparse.Namespace):
    from qwen35_tvm.runtime.sampler import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
    )


def _generate(args: argparse.Namespace) -> None:
    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.generate import Generator
    from qwen35_tvm.runtime.tokenizer import TextTokenizer

    params = _sampling(args)
    artifact = Artifact(args.artifact, device=args.device)
    tokenizer = TextTokenizer.from_dir(args.artifact)
    text = args.prompt
    if args.chat:
        text = tokenizer.render_chat([{"role": "user", "content": args.prompt}])
    generator = Generator(artifact)
    detok = tokenizer.detokenizer(skip_special=True)
    for token in generator.generate(tokenizer.encode(text), params, args.max_tokens):
        sys.stdout.write(detok.feed(token))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")


def _score(args: argparse.Namespace) -> None:
    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.generate import Generator
    from qwen35_tvm.runtime.tokenizer import TextTokenizer

    if args.ids is not None:
        try:
            ids = [int(x) for x in args.ids.split(",") if x.strip()]
        except ValueError:
            raise SystemExit(f"--ids must be comma-separated integers, got {args.ids!r}") from None
    else:
        ids = TextTokenizer.from_dir(args.artifact).encode(args.text)
    generator = Generator(Artifact(args.artifact, device=args.device))
    for s in generator.score(ids, top_k=args.top_k):
        top = [[t, lp] for t, lp in s.top]
        line = {"position": s.position, "token": s.token, "logprob": s.logprob, "top": top}
        print(json.dumps(line))


def _serve(args: argparse.Namespace) -> None:
    from qwen35_tvm.server.app import ServerConfig, serve

    cfg = ServerConfig(
        api_key=args.api_key, model_name=args.model_name, max_waiting=args.max_waiting
    )
    serve(
        args.artifact,
        host=args.host,
        port=args.port,
        device=args.device,
        max_batch=args.max_batch,
        max_total_tokens=args.max_total_tokens,
        cfg=cfg,
        memory_fraction=args.memory_fraction,
        mixed_step_share=args.mixed_step_share or None,
        mixed_step_min_tokens=args.mixed_step_min_tokens,
    )


def _bench(args: argparse.Namespace) -> None:
    try:
        from qwen35_tvm.cli.bench import BenchConfig, failed_requests, parse_levels, run
    except ImportError as e:  # httpx is in the server/test extras, not the base install
        raise SystemExit(f"qwen35-tvm bench: needs {e.name} (pip install {e.name})") from None

    cfg = BenchConfig(
        url=args.url,
        concurrency=parse_levels(args.concurrency),
        input_len=args.input_len,
        output_len=args.output_len,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        api_key=args.api_key,
        model=args.model,
        seed=args.seed,
        logprobs=args.logprobs,
        timeout=args.timeout,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
    )
    failed = failed_requests(run(cfg, out=args.out, plot_path=args.plot))
    if failed:
        raise SystemExit(f"qwen35-tvm bench: {failed} request(s) failed")


def _parser() -> argparse.ArgumentParser:
    from qwen35_tvm.runtime.step_costs import (  # numpy only: no TVM, no compiler
        MIN_TOKENS,
        MIXED_STEP_SHARE,
    )

    p = argparse.ArgumentParser(prog="qwen35-tvm", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile a model folder (or tiny-random) to an artifact")
    c.add_argument("model", help="a Hugging Face Qwen3.5 folder, or 'tiny-random'")
    c.add_argument("-o", "--output", required=True, help="artifact folder to write")
    c.add_argument("--target", default="llvm", choices=["llvm", "cuda"])
    c.add_argument("--arch", default="sm_80", help="CUDA SM architectures, e.g. sm_80,sm_90")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--context-window", type=int, default=None, help="longest sequence served")
    c.add_argument("--no-convert", action="store_true", help="build the library only")
    c.add_argument("--no-cuda-graph", action="store_true", help="CUDA: run decode kernel by kernel")
    c.add_argument(
        "--no-dependent-launch",
        action="store_true",
        help="CUDA: start each kernel after the one before it ends (no sm_90 early launch)",
    )
    c.set_defaults(func=_compile)

    v = sub.add_parser("convert", help="convert a checkpoint's weights into an artifact")
    v.add_argument("model")
    v.add_argument("artifact")
    v.set_defaults(func=_convert)

    k = sub.add_parser("pack", help="an offline deploy bundle: artifact, wheels, install.sh")
    k.add_argument("artifact")
    k.add_argument("-o", "--output", required=True, help="bundle folder to write")
    k.add_argument("--python", default="3.12", help="the server's Python, e.g. 3.12")
    k.add_argument("--no-weights", action="store_true", help="leave out params-*.safetensors")
    k.add_argument("--zip", action="store_true", help="also write OUTPUT.zip")
    k.add_argument("--glibc", default="2.28", help="the server's glibc (newest manylinux tag)")
    k.add_argument(
        "--with",
        dest="extra",
        action="append",
        default=[],
        metavar="REQ",
        help="one more requirement to ship (repeatable)",
    )
    k.add_argument("--cache-dir", default=None, help="keep the 100 MB apache-tvm wheel here")
    k.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    k.set_defaults(func=_pack)

    r = sub.add_parser("random-model", help="write random weights at real shapes")
    r.add_argument("--shape", required=True, choices=["tiny", "0.8b", "2b", "4b", "9b"])
    r.add_argument("-o", "--output", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    r.set_defaults(func=_random_model)

    for name, helptext, func in (
        ("generate", "generate text from a prompt", _generate),
        ("score", "teacher-forced logprobs as JSON lines", _score),
    ):
        g = sub.add_parser(name, help=helptext)
        g.add_argument("artifact")
        g.add_argument("--device", default=None, choices=["cpu", "cuda"])
        g.set_defaults(func=func)
        if name == "generate":
            g.add_argument("--prompt", required=True)
            g.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn")
            g.add_argument("--max-tokens", type=int, default=64)
            g.add_argument("--temperature", type=float, default=0.0)
            g.add_argument("--top-p", type=float, default=1.0)
            g.add_argument("--top-k", type=int, default=-1)
            g.add_argument("--min-p", type=float, default=0.0)
            g.add_argument("--seed", type=int, default=None)
        else:
            src = g.add_mutually_exclusive_group(required=True)
            src.add_argument("--text")
            src.add_argument("--ids", help="comma-separated token ids")
            g.add_argument("--top-k", type=int, default=5)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over an artifact")
    s.add_argument("artifact")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (local only by default)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    s.add_argument("--device", default=None, choices=["cpu", "cuda"])
    s.add_argument("--max-waiting", type=int, default=256, help="queued requests before 503")
    s.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    s.add_argument(
        "--memory-fraction",
        type=float,
        default=0.5,
        help="on a GPU without --max-total-tokens: share of free memory for KV pages and GDN slots",
    )
    s.add_argument(
        "--mixed-step-share",
        type=float,
        default=MIXED_STEP_SHARE,
        help="prompt tokens beside running decodes: what takes this times a decode step "
        "(0: always the whole prefill chunk)",
    )
    s.add_argument(
        "--mixed-step-min-tokens",
        type=int,
        default=MIN_TOKENS,
        help="with --mixed-step-share: the fewest prompt tokens a mixed step takes, so that "
        "long prompts keep moving when even a small chunk costs more than the share",
    )
    s.add_argument("--model-name", default=None, help="served model id (default: folder name)")
    s.set_defaults(func=_serve)

    b = sub.add_parser("bench", help="a serving benchmark against a running server (HTTP only)")
    b.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    b.add_argument("--concurrency", default="1", help="levels of requests in flight, e.g. 1,8,16")
    b.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request")
    b.add_argument("--output-len", type=int, default=256, help="generated tokens per request")
    b.add_argument("--num-prompts", type=int, default=100, help="requests per level")
    b.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson request starts per second (default inf: all at once, capped by level)",
    )
    b.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    b.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    b.add_argument("--seed", type=int, default=0, help="seeds the prompts and arrival times")
    b.add_argument("--logprobs", action="store_true", help="a chunk per token: exact ITL")
    b.add_argument("--timeout", type=float, default=300.0, help="seconds to wait on a read")
    b.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    b.add_argument("--top-p", type=float, default=None, help="sent where given")
    b.add_argument("--top-k", type=int, default=None, help="sent where given")
    b.add_argument("--min-p", type=float, default=None, help="sent where given")
    b.add_argument("--out", default=None, help="write the results as JSON here")
    b.add_argument("--plot", default=None, help="draw throughput and latency to this PNG")
    b.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        # Users' mistakes (bad config, bad prompt, missing files) get one line, not a traceback.
        raise SystemExit(f"qwen35-tvm {args.command}: error: {e}") from None


if __name__ == "__main__":
    main()
