"""The engine on the Triton attention backend (paged prefill + decode kernels and
the KV-write kernel) gives the torch backend's tokens, and so does the fused GPU
form of the layers (`engine/models/fused.py`: fused qkv / gate_up GEMMs, RMSNorm
+ residual, rotary and SwiGLU kernels), forced on here since it is CUDA-only by default. On CPU the kernels run in
Triton's interpreter, which must be switched on before they are defined, so the
check runs in a fresh interpreter process."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.fixtures.models import build_hf_checkpoint
from tests.fixtures.triton_version import OLD_INTERPRETER_REASON, old_interpreter

triton = pytest.importorskip("triton")

SCRIPT = r"""
import json, sys, torch
torch.set_num_threads(1)
from splitserve import LLM, SamplingParams
from splitserve.engine.models.fused import fuse_projections
prompts = [[5, 9, 22, 7, 1, 3, 8, 40, 41, 42, 43, 44, 45], [8, 3], list(range(60, 81))]
params = SamplingParams(num_tokens_to_generate=6, temperature=0.0, ignore_eos=True, return_log_probs=True)
out = {}
from splitserve.engine.models import fused
from splitserve.kernels.linear import LinearConfig
# "fused_own": every projection through our kernel (as on Hopper), rotary and the KV write in the qkv
# kernel (the qkv bias of qwen2 keeps it on the unfused path), SwiGLU in the gate_up kernel, the
# MLP's down projection split over K into partials that the next add+RMSNorm sums, the post-attention
# add+RMSNorm folded into the o and gate_up kernels; forced here,
# where none is measured faster
# "fused_whole": the same with an unsplit down projection. Both fold the decoder norms: γ into the qkv and
# gate_up weights, the adds into the o and down kernels' epilogues, 1 / rms into qkv's and gate_up's (RowNorm)
OWN = {"qkv": LinearConfig(16, 16, 4, 2), "o": LinearConfig(16, 32, 4, 2), "gate_up": LinearConfig(32, 16, 4, 2),
       "down": LinearConfig(16, 16, 4, 2, splits=3)}
WHOLE = dict(OWN, down=LinearConfig(16, 16, 4, 2))
# "fused_own_plain": OWN with the norms not folded (the default until SPLITSERVE_FOLD_NORM=1 is measured)
for name in ("torch", "triton", "fused", "fused_own", "fused_whole", "fused_own_plain"):
    backend = "torch" if name == "torch" else "triton"
    # device="cpu": Triton's interpreter; on a CUDA host the engine would otherwise pick the GPU
    llm = LLM(sys.argv[1], device="cpu", attention_backend=backend, block_size_tokens=4, num_blocks=64, max_tokens=16)
    assert llm.engine.runner.backend == backend and not llm.engine.runner.model.fused
    if name.startswith("fused_"):  # before fusing: the norms' γ goes into the weights then
        table = WHOLE if name == "fused_whole" else OWN
        fused.projection_config = lambda kind, rows, device, dtype, _t=table: _t[kind]
        fused._FOLD_NORM = name != "fused_own_plain"
    if name.startswith("fused"):
        fuse_projections(llm.engine.runner.model)
        assert (llm.engine.runner.model.unit_gamma is not None) == (name in ("fused_own", "fused_whole"))
    if name.startswith("fused_"):
        launched = []
        for fn in ("decode_linear_partials", "decode_linear_glu", "decode_qkv_rotary", "decode_linear_add"):
            own = getattr(fused.kernels, fn)
            if hasattr(own, "own"):
                own = own.own
            wrap = lambda *a, _own=own, _fn=fn, **kw: (launched.append(_fn + ("+norm" if len(a) > 8 and a[8] else ""))
                                                        or _own(*a, **kw))
            wrap.own = own
            setattr(fused.kernels, fn, wrap)
    res = llm.generate(prompts, params)
    llm.engine.check_integrity()
    out[name] = [[r.generated_tokens, r.generated_log_probs] for r in res]
    if name.startswith("fused_"):
        # layer 1's qkv takes the norm of what layer 0's down added (split: its last programs summed
        # the partials); the last layer's down adds into the residual stream too
        want = {"decode_linear_glu", "decode_qkv_rotary", "decode_linear_add", "decode_qkv_rotary+norm"}
        if llm.engine.runner.model.layers[0].self_attn.qkv_bias is not None:  # no fold into the unfused qkv:
            want -= {"decode_qkv_rotary", "decode_qkv_rotary+norm"}  # layer 0's down leaves its partials
            want |= {"decode_linear_partials"} if name == "fused_own" else set()
        if name == "fused_own_plain":  # norm kernels between; the split down's partials summed by them
            want = {"decode_linear_partials", "decode_linear_glu", "decode_qkv_rotary"}
            if llm.engine.runner.model.layers[0].self_attn.qkv_bias is not None:
                want.remove("decode_qkv_rotary")
        assert set(launched) == want, launched
print(json.dumps(out))
"""


@pytest.mark.parametrize(
    "family,shape",
    [("llama", {}), ("qwen2", {}), ("llama", dict(hidden_size=96, num_attention_heads=2, num_key_value_heads=1))],
    ids=["llama", "qwen2", "llama-head-dim-48"],
)
@pytest.mark.skipif(old_interpreter(), reason=OLD_INTERPRETER_REASON)
def test_triton_backend_matches_torch(tmp_path, family, shape):
    build_hf_checkpoint(tmp_path, family, **{"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64, **shape})
    _spread_norm_weights(tmp_path)
    env = dict(os.environ, TRITON_INTERPRET="1", SPLITSERVE_FOLD_NORM="1")  # the folded norms: opt-in (not faster on a GPU)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for variant in ("triton", "fused", "fused_own", "fused_whole", "fused_own_plain"):
        for (t_tokens, t_lp), (k_tokens, k_lp) in zip(out["torch"], out[variant], strict=True):
            assert k_tokens == t_tokens, variant
            assert max(abs(a - b) for a, b in zip(t_lp, k_lp, strict=True)) < 1e-4, variant


def _spread_norm_weights(path) -> None:
    """Norm weights (γ) away from the ones `transformers` initializes them to, so a γ folded into
    the projections (fused_own / fused_whole) is a γ that matters."""
    from safetensors.torch import load_file, save_file

    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        g = torch.Generator().manual_seed(5)
        for name, t in tensors.items():
            if name.endswith("norm.weight"):
                tensors[name] = (1 + 0.3 * torch.randn(t.shape, generator=g)).to(t.dtype)
        save_file(tensors, f, metadata={"format": "pt"})
