"""The hybrid engine on the Triton path (paged attention kernels plus the Mamba2
`selective_state_update` / `ssd_chunk_scan` / `causal_conv1d[_update]` kernels) gives the torch
path's tokens.
On CPU the kernels run in Triton's interpreter, which must be on before they are
defined, so the check runs in a fresh interpreter process."""

import json
import os
import subprocess
import sys

import pytest

from tests.fixtures.models import build_hybrid_checkpoint
from tests.fixtures.triton_version import OLD_INTERPRETER_REASON, old_interpreter

pytest.importorskip("triton")

SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(1)
from splitserve import LLM, SamplingParams
prompts = [[5, 9, 22, 7, 1, 3, 8, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [8, 3], list(range(60, 81))]
params = SamplingParams(num_tokens_to_generate=6, temperature=0.0, ignore_eos=True, return_log_probs=True)
out = {}
for backend in ("torch", "triton"):
    llm = LLM(sys.argv[1], device="cpu", attention_backend=backend, block_size_tokens=4, num_blocks=64, max_tokens=16)
    assert llm.engine.runner.backend == backend
    res = llm.generate(prompts, params)
    llm.engine.check_integrity()
    out[backend] = [[r.generated_tokens, r.generated_log_probs] for r in res]
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(old_interpreter(), reason=OLD_INTERPRETER_REASON)
def test_hybrid_triton_path_matches_torch(tmp_path):
    build_hybrid_checkpoint(tmp_path)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for (t_tokens, t_lp), (k_tokens, k_lp) in zip(out["torch"], out["triton"], strict=True):
        assert k_tokens == t_tokens
        assert max(abs(a - b) for a, b in zip(t_lp, k_lp, strict=True)) < 1e-4


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_hybrid_triton_path_matches_torch_on_the_gpu(tmp_path):
    """The same check with the kernels compiled for the GPU (fp32)."""
    from splitserve import LLM, SamplingParams

    build_hybrid_checkpoint(tmp_path)
    prompts = [[5, 9, 22, 7, 1, 3, 8, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [8, 3], list(range(60, 81))]
    params = SamplingParams(num_tokens_to_generate=6, temperature=0.0, ignore_eos=True, return_log_probs=True)
    out = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", attention_backend=backend, block_size_tokens=4,
                  num_blocks=64, max_tokens=16)
        out[backend] = llm.generate(prompts, params)
        llm.engine.check_integrity()
    for t, k in zip(out["torch"], out["triton"], strict=True):
        assert k.generated_tokens == t.generated_tokens
        assert max(abs(a - b) for a, b in zip(t.generated_log_probs, k.generated_log_probs, strict=True)) < 1e-3
