"""Serving never loads the compiler: the runtime runs on TVM's runtime library alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, sys
from qwen35_tvm.runtime.artifact import Artifact
from qwen35_tvm.runtime.generate import Generator
from qwen35_tvm.runtime.sampler import SamplingParams
import qwen35_tvm.runtime.engine, qwen35_tvm.runtime.grammar
gen = Generator(Artifact(sys.argv[1]))
tokens = list(gen.generate([9419, 11], SamplingParams(temperature=0.0), 4, stop_ids=[]))
maps = open("/proc/self/maps").read()
print(json.dumps({
    "tokens": tokens,
    "compiler_lib_mapped": "libtvm_compiler" in maps,
    "xgrammar_loaded": "xgrammar" in sys.modules,
    "compiler_modules": sorted(m for m in sys.modules
                               if m.startswith(("tvm.relax", "tvm.s_tir", "tvm.topi",
                                                "qwen35_tvm.compile", "qwen35_tvm.schedules"))),
}))
"""


def test_runtime_generates_without_the_compiler(tiny_random_artifact):
    env = {k: v for k, v in os.environ.items() if k != "TVM_USE_RUNTIME_LIB"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tiny_random_artifact)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["tokens"]) == 4
    assert result["compiler_modules"] == []
    assert result["compiler_lib_mapped"] is False
    # xgrammar (which needs torch) loads with the first constrained request only: a packed
    # bundle has neither
    assert result["xgrammar_loaded"] is False
