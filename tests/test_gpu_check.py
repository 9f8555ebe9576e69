"""bench/gpu_check.py runs here: the quick parts, with the GPU-only ones skipped on a CPU (the
whole script takes ~80 s on this CPU and is run by hand; docs/gpu.md)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # runs bench/gpu_check.py's quick parts in a subprocess


def test_gpu_check_quick_parts_run_and_skip_what_needs_a_gpu(tmp_path):
    out = tmp_path / "check.json"
    run = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu_check.sh"), "--parts", "versions,throughput,fp16,decoder",
                          "--json", str(out)], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["fp16"]["returncode"] != 0 and not r["fp16"]["traceback"] and "fp16" in r["fp16"]["message"]
    full, lora = r["decoder"]["full"], r["decoder"]["lora"]  # the decoder part's CPU form: a tiny Qwen3
    assert full["plan_equals_tensors"] and lora["plan_equals_tensors"] and lora["trained"] < full["trained"] / 3
    assert full["tokens_per_s"] > 0 and lora["tokens_per_s"] > 0
    if torch.cuda.is_available():
        assert r["versions"]["accelerator"]["type"] == "cuda" and isinstance(r["throughput"], dict)
    else:
        from retrieval_kit.precision import cpu_bf16_matmul

        assert r["versions"]["auto"] == {"compute_dtype": "bf16" if cpu_bf16_matmul() else "none", "tf32": False,
                                         "chunk_tokens": 1024, "keep_freed_memory": True}
        assert r["throughput"] == "skipped (no GPU)" and "skipped (no GPU)" in run.stdout
