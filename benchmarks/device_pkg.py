"""The packages a GPU server with no package index and no compiler needs to run this checkout's
benchmarks: TVM's runtime-only rebuild (compile/bundle_wheels.py) and tvm-ffi for the server's
Python, unpacked into DIR (default .bundle/pkg, which git ignores) beside links to this
checkout's packages, so that there `PYTHONPATH=$PWD/.bundle/pkg:$PWD` imports `tvm` and
`qwen35_tvm`. With --server, also the server's requirements for benchmarks/serving.sh
(those the server's torch environment may lack). Name DIR's top folder in the run's `carry`.

  here:           python benchmarks/device_pkg.py [DIR] [--python 3.12] [--server]
  on the server:  PYTHONPATH=$PWD/.bundle/pkg:$PWD python benchmarks/...
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("compile", "runtime", "schedules", "server", "cli")  # qwen35_tvm.<name> = <name>/
SERVER = ("fastapi", "uvicorn", "prometheus-client", "httpx", "jsonschema")


def build(out: Path, python: str, server: bool) -> None:
    from qwen35_tvm.compile.bundle_wheels import (
        TVM_COMPILER_ONLY,
        download_tvm_wheel,
        manylinux_platforms,
        rewrite_wheel,
        run_pip,
        target_args,
        tvm_ffi_pin,
    )

    tvm_version = importlib.metadata.version("apache-tvm").split("+")[0]
    ffi = tvm_ffi_pin(tvm_version)  # model.so is linked against its ABI
    platforms = manylinux_platforms()
    if out.exists():
        shutil.rmtree(out)
    (out / "qwen35_tvm").mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="qwen35-device-pkg-") as tmp:
        wheels = Path(tmp) / "wheels"
        wheels.mkdir()

        def download(args: list[str], what: str) -> None:
            run_pip(["download", "-d", str(wheels), *target_args(python, platforms), *args], what)

        full = download_tvm_wheel(tvm_version, python, platforms, Path(tmp) / "full")
        rewrite_wheel(full, wheels, "runtime", TVM_COMPILER_ONLY)
        download(["--no-deps", f"apache-tvm-ffi=={ffi}"], "download apache-tvm-ffi")
        if server:
            download(list(SERVER), "download the server's requirements")
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(out)
            print(f"unpacked {wheel.name}", flush=True)
    for name in PACKAGES:  # relative links: they hold wherever the checkout is copied
        rel = Path("..", *([".."] * len(out.resolve().relative_to(ROOT).parts)), name)
        (out / "qwen35_tvm" / name).symlink_to(rel)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("dir", type=Path, nargs="?", default=ROOT / ".bundle" / "pkg")
    p.add_argument("--python", default="3.12", help="the GPU server's Python (major.minor)")
    p.add_argument("--server", action="store_true", help="also the server's requirements")
    args = p.parse_args()
    if not args.dir.resolve().is_relative_to(ROOT):
        raise SystemExit(f"{args.dir}: must be inside the checkout (its links are relative)")
    build(args.dir, args.python, args.server)


if __name__ == "__main__":
    main()
