"""`pack`: an artifact plus everything needed to serve it, for a server with no package index.

The bundle is a folder (optionally also a .zip) holding the artifact, a wheel of every
package the runtime and the server import, resolved by pip for the target Python and platform,
and `install.sh`, which makes a venv from those wheels alone. The wheels, TVM's rebuilt
runtime-only among them, come from `bundle_wheels`; this module writes the artifact, the
manifest, the install script and the archive around them.

Packing needs no compiler: this module never imports tvm.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .bundle_wheels import fetch_wheels, log, manylinux_platforms

BUNDLE_FORMAT = 1
# Files the runtime reads besides the weights; the first four are required.
ARTIFACT_CORE = ("artifact.json", "config.json", "model.so", "tokenizer.json")
ARTIFACT_OPTIONAL = ("chat_template.jinja",)
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _copy_artifact(src: Path, dst: Path, weights: bool) -> dict:
    missing = [n for n in ARTIFACT_CORE if not (src / n).is_file()]
    if missing:
        raise FileNotFoundError(f"{src}: not an artifact, it lacks {', '.join(missing)}")
    meta = json.loads((src / "artifact.json").read_text())
    if weights and not meta.get("weights"):
        log(f"warning: {src} has no weights; add them to the bundle's artifact/ to serve")
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
        reqs, names = fetch_wheels(staging, meta, python, platforms, extra_requirements, cache_dir)
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
    log(f"bundle written to {out} ({sizes}) in {time.time() - started:.0f} s")
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
