"""The GPU form of the Llama-family layer: fused projections and fused kernels.

A decode step of a small model is hundreds of tiny kernels (each RMSNorm is
~8 elementwise ops, rotary ~5 per tensor, SwiGLU 2, plus separate q/k/v and
gate/up GEMMs); on an H200 their launch gaps, not HBM, bound the step even
inside a CUDA graph. This form runs per layer

    add+RMSNorm -> qkv GEMM -> rotary(q, k) + write_kv -> attention -> o GEMM
                   (one kernel at decode sizes on Hopper)
    -> add+RMSNorm -> gate_up GEMM -> silu*mul -> down GEMM
       (the add and the norm's statistics in the o kernel's epilogue; the norm — γ in the
        weight, 1 / rms on the sums — GEMM and silu*mul in one kernel at decode sizes on Hopper)

and the next layer's add+RMSNorm folds the same way (the add in the down kernel — a split
down's last program per column tile sums the partials first — the norm in the qkv kernel):
no norm kernel inside the stack at decode sizes on Hopper — with `SPLITSERVE_FOLD_NORM=1` (see
`_FOLD_NORM`); by default the two add+RMSNorms of a layer are kernels of their own.

carrying the residual stream separately (`residual`), so each residual add
rides in the next norm's kernel. `fuse_projections` concatenates q/k/v and
gate/up weights once and re-points the per-projection parameters at views of
the fused tensors, so the checkpoint loader (and a lifecycle reload, which
calls it again) keep working and no memory is duplicated.

`logits` is the last stage's head in the same spirit: the Triton RMSNorm, then
fp32 logits straight from `kernels.decode_linear` at decode sizes (one launch
instead of a cuBLAS GEMM, an upcast of [B, vocab] and ~8 norm kernels).

Used only where the Triton kernels run on CUDA (`build_model`); the CPU path
keeps the unfused modules, the numerical reference of the tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from splitserve import kernels
from splitserve.engine.attention import (
    TRITON_KERNEL_BACKENDS,
    AttentionMetadata,
    paged_attention,
    triton_attention_written,
)
from splitserve.engine.models.rope import StepRotary
from splitserve.kernels.projection_configs import projection_config


def _fuse(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the modules' weights (and biases) by output rows; the modules'
    parameters become views of the result."""
    weight = torch.cat([m.weight.data for m in modules])
    bias = None
    if modules[0].bias is not None:
        bias = torch.cat([m.bias.data for m in modules])
    row = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = weight[row : row + n]
        if bias is not None:
            m.bias.data = bias[row : row + n]
        row += n
    return weight, bias


def fuse_projections(model) -> None:
    """Give every decoder layer fused qkv and gate_up weights (idempotent; call
    again after the weights are replaced).

    Where the decode kernels fold the decoder norms (`folds_norms`), the fused weights also hold
    the norm before each — input_layernorm's γ in qkv's columns, post_attention_layernorm's in
    gate_up's — and `model.unit_gamma` (ones) stands in for γ wherever a norm kernel still runs
    before them (prefill sizes, the first layer, TP > 1): one form at every size. The per-
    projection modules are views of the fused weights, so they hold γ too; the unfused forward
    is never run on a fused model."""
    fold = folds_norms(model)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        fused = getattr(attn, "qkv_weight", None)
        if fused is not None and attn.q_proj.weight.data_ptr() == fused.data_ptr():
            continue  # fused already, and not reloaded since: γ is in it once
        attn.qkv_weight, attn.qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.gate_up_weight, _ = _fuse([mlp.gate_proj, mlp.up_proj])
        if fold:
            attn.qkv_weight.mul_(layer.input_layernorm.weight.data)
            mlp.gate_up_weight.mul_(layer.post_attention_layernorm.weight.data)
    model.unit_gamma = torch.ones_like(model.layers[0].input_layernorm.weight) if fold else None
    model.fused = True


def folds_norms(model) -> bool:
    """Whether the decode kernels take this model's decoder norms folded (`kernels.RowNorm`): our
    qkv and gate_up kernels run its dtype on its device (`projection_config`) and
    `SPLITSERVE_FOLD_NORM=1`."""
    if not len(model.layers) or not (_FOLD_NORM and _OWN_PROJECTIONS):
        return False
    w = model.layers[0].self_attn.q_proj.weight
    return all(projection_config(kind, 1, w.device, w.dtype) is not None for kind in ("qkv", "gate_up"))


_OWN_PROJECTIONS = os.environ.get("SPLITSERVE_DECODE_GEMM", "1") != "0"
"""`SPLITSERVE_DECODE_GEMM=0` keeps every projection on cuBLAS (an A/B switch for benchmarks)."""
_FOLD_NORM = os.environ.get("SPLITSERVE_FOLD_NORM", "0") == "1"
"""`SPLITSERVE_FOLD_NORM=1` folds the decoder norms into the projections (`fuse_projections`,
`kernels.RowNorm`). Off by default: correct on CPU (Triton's interpreter,
tests/engine/test_triton_backend.py) and on GPUs (bf16 agreement unchanged), but not faster —
five launches a layer instead of seven, yet batch-64 replays 1.2% slower on an H200 and batch 1
2% slower on an H100: the qkv and gate_up kernels wait on the add's statistics and load up to
128 partial sums of squares a row (benchmarks/RESULTS.md, session 30); session 25's first form
(x normalized inside the K loop) was slower still."""


def _project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str, partials: bool = False
) -> torch.Tensor:
    """F.linear, or at decode sizes on Hopper with PDL our weight-streaming kernel where it was
    measured faster (`kernels.projection_configs`); same fp32 accumulation, one rounding.
    `partials`: the caller also takes fp32 split-K partials [S, T, N] (a split config's result,
    summed and rounded by the next add+RMSNorm)."""
    config = _own_config(kind, x) if bias is None else None
    if _unsplit(config):
        return kernels.decode_linear(x, weight, config=config)
    if config is not None and partials:
        return kernels.decode_linear_partials(x, weight, config)
    return F.linear(x, weight, bias)


def _own_config(kind: str, x: torch.Tensor):
    """`projection_config` for this projection of x, unless `SPLITSERVE_DECODE_GEMM=0`."""
    return projection_config(kind, x.shape[0], x.device, x.dtype) if _OWN_PROJECTIONS else None


def _qkv_config(attn, x: torch.Tensor, meta: AttentionMetadata):
    """The config of our qkv kernel (projection, rotary and the KV write: one launch) where it
    runs this layer's attention input x, else None."""
    config = _own_config("qkv", x) if meta.backend in TRITON_KERNEL_BACKENDS and attn.qkv_bias is None else None
    return config if _unsplit(config) else None


def _attention_launched_early(rows: int, kv: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether the qkv kernel lets our decode attention's programs launch while it still runs (PDL
    mode 2), rather than as it exits. Early only before a split attention of more than 16 rows:
    H100 batch replays, early against at exit (benchmarks/RESULTS.md, 2026-12-06 session 33), at
    1-16 rows −0.3 to −3.5% at exit, at 24 and 32 rows (split) +3.7 / +4.0%, at 48 and 64 rows
    (unsplit: one launch, 96 KB programs) −0.2 / −0.45%. FlashInfer's and prefill steps' attention
    keep the early signal."""
    if meta.planned is not None or not meta.is_decode_only:
        return True
    return rows > 16 and not kernels.decode_attention_unsplit(rows, kv, meta.block_tables.shape[1])


def _attention(attn, x: torch.Tensor, rope: StepRotary, kv: torch.Tensor, meta: AttentionMetadata, norm=None
               ) -> torch.Tensor:
    """The attention heads' output [T, heads * head_dim] of normed x [T, H], before the o
    projection; with `norm` (a `kernels.RowNorm`, only where `_qkv_config` is ours) of x
    normalized by the qkv kernel. Our qkv kernel gathers its rotary rows from the tables where
    there are tables (`GATHER_ROTARY`)."""
    t, d = x.shape[0], attn.head_dim
    triton_kv = meta.backend in TRITON_KERNEL_BACKENDS
    config = _qkv_config(attn, x, meta)
    if config is not None:
        gather = rope.tables is not None and GATHER_ROTARY
        cos, sin = rope.tables if gather else rope.cos_sin()
        q = kernels.decode_qkv_rotary(x, attn.qkv_weight, cos, sin, kv, meta.slot_mapping, attn.num_heads, config,
                                      norm, positions=rope.positions if gather else None,
                                      signal_early=_attention_launched_early(t, kv, meta))
        o = triton_attention_written(q, kv, meta, attn.scale)
    else:
        cos, sin = rope.cos_sin()
        qkv = _project(x, attn.qkv_weight, attn.qkv_bias, "qkv")
        nq, nk = attn.num_heads * d, attn.num_kv_heads * d
        q = qkv[:, :nq].view(t, attn.num_heads, d)
        k = qkv[:, nq : nq + nk].view(t, attn.num_kv_heads, d)
        v = qkv[:, nq + nk :].view(t, attn.num_kv_heads, d)
        if triton_kv:  # rotary and the KV write in one launch
            kernels.apply_rotary_qk_and_write_kv(q, k, v, cos, sin, kv, meta.slot_mapping)
            o = triton_attention_written(q, kv, meta, attn.scale)
        else:
            kernels.apply_rotary_qk(q, k, cos, sin)
            o = paged_attention(q, k, v, kv, meta, attn.scale)
    return o.reshape(t, -1)


def _post_attention(layer, o: torch.Tensor, residual: torch.Tensor, unit: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up of the MLP from the attention heads' output o: the o projection, the
    residual add (`residual` updated in place), the post-attention RMSNorm, the gate_up
    projection and SwiGLU. Where both projections run ours on one TP rank the norm takes no
    launch: the o kernel adds the residual and sums the new rows' squares per column tile in
    its epilogue (`kernels.decode_linear_add`), the gate_up kernel, its weight holding γ, scales
    its sums by each row's 1 / rms (`kernels.RowNorm`). `unit`: ones where γ is folded
    (`fuse_projections`), else None."""
    attn, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    o_config, gu_config = _own_config("o", o), _own_config("gate_up", residual)
    if (unit is not None and attn.ps.tp_size == 1 and attn.o_proj.bias is None and o.dtype == residual.dtype
            and _unsplit(o_config) and _unsplit(gu_config)):
        squares = kernels.decode_linear_add(o, attn.o_proj.weight, residual, o_config)
        return kernels.decode_linear_glu(residual, mlp.gate_up_weight, gu_config, kernels.RowNorm(norm.eps, squares))
    out = attn.ps.all_reduce_tp(_project(o, attn.o_proj.weight, attn.o_proj.bias, "o"))
    gamma = norm.weight if unit is None else unit
    return _gate_up_act(kernels.rms_norm(out, gamma, norm.eps, residual=residual), mlp.gate_up_weight)


def _unsplit(config) -> bool:
    return config is not None and config.splits == 1


def _gate_up_act(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused gate/up projection: in the projection's own kernel where it
    runs ours (`kernels.decode_linear_glu`: no [T, 2I] intermediate, one launch less a layer),
    else cuBLAS then `kernels.silu_and_mul`; the same roundings either way."""
    config = _own_config("gate_up", x)
    if _unsplit(config):
        return kernels.decode_linear_glu(x, weight, config)
    return kernels.silu_and_mul(F.linear(x, weight))


def _down(mlp, act: torch.Tensor, residual: torch.Tensor | None):
    """(x, None): x [T, H], or (one TP rank: nothing to all-reduce) fp32 split-K partials
    [S, T, H] for the next layer's add+RMSNorm to sum. Or, given the `residual` to fold into
    (the next layer's qkv kernel takes the norm) and where the projection runs ours on one
    rank: (None, squares) — the residual add done in the down kernel's epilogue, split or not
    (`kernels.decode_linear_add`)."""
    config = _own_config("down", act)
    if residual is not None and mlp.ps.tp_size == 1 and mlp.down_proj.bias is None and config:
        return None, kernels.decode_linear_add(act, mlp.down_proj.weight, residual, config)
    down = _project(act, mlp.down_proj.weight, mlp.down_proj.bias, "down", partials=mlp.ps.tp_size == 1)
    return mlp.ps.all_reduce_tp(down), None


GATHER_ROTARY = True
"""Our qkv kernel gathers each row's cos / sin from the rotary tables by position
(`kernels.decode_qkv_rotary(..., positions=)`) instead of taking rows torch gathered: one torch
launch less a step. False: torch's gather (an A/B switch for benchmarks/decode_sweep.py)."""

GATHER_EMBEDDING = True
"""The first stage's token embedding is gathered by the first layer's input-norm kernel
(`kernels.embed_rms_norm`) instead of torch's embedding kernel: one launch less a step, and
none outside the PDL chain. False: torch's (an A/B switch for benchmarks/decode_sweep.py)."""


def gathers_embedding(model) -> bool:
    """Whether `fused_layers_forward` takes token ids for this model (see GATHER_EMBEDDING)."""
    return GATHER_EMBEDDING and model.embed_tokens is not None and len(model.layers) > 0


def fused_layers_forward(
    model,
    hidden: torch.Tensor | None,
    rope: StepRotary,
    kv_caches: Sequence[torch.Tensor],
    meta: AttentionMetadata,
    after_layer: Callable[[int], None] | None = None,
    input_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The stage's decoder layers over hidden [T, H] — or, given `input_ids` [T] instead
    (`gathers_embedding`), over their embeddings, gathered by the first norm's kernel; `rope`:
    the step's rotary tables / rows (`StepRotary`); returns
    the full hidden state (residual stream included), like the unfused loop. `hidden` is
    consumed: it becomes the residual buffer and is updated in place. `after_layer(i)` is called
    once local layer i's KV write is queued (layer-wise streaming: engine/handoff_layerwise.py)."""
    residual = squares = None
    x = hidden
    layers, unit = list(model.layers), getattr(model, "unit_gamma", None)
    for i, (layer, kv) in enumerate(zip(layers, kv_caches, strict=True)):
        norm_in, row_norm = layer.input_layernorm, None
        gamma = norm_in.weight if unit is None else unit  # γ is in the qkv weight where folded
        if residual is None and input_ids is not None:
            h, residual = kernels.embed_rms_norm(input_ids, model.embed_tokens.weight, gamma, norm_in.eps)
        elif residual is None:
            residual = x
            h = kernels.rms_norm(x, gamma, norm_in.eps)
        elif squares is not None:  # the previous down kernel added into the residual: the norm is the qkv kernel's
            h, row_norm = residual, kernels.RowNorm(norm_in.eps, squares)
        else:
            h = kernels.rms_norm(x, gamma, norm_in.eps, residual=residual)
        o = _attention(layer.self_attn, h, rope, kv, meta, row_norm)
        if after_layer is not None:
            after_layer(i)
        act = _post_attention(layer, o, residual, unit)
        # folded, the last layer's add too: the stage's output is then the residual stream itself,
        # with no reduction, cast and add of torch's after the last (PDL-launched) kernel
        fold = unit is not None and (i + 1 == len(layers) or _qkv_config(layers[i + 1].self_attn, residual, meta))
        x, squares = _down(layer.mlp, act, residual if fold else None)
    if residual is None:
        return hidden
    if x is None:  # folded: the residual stream is the output
        return residual
    # the last layer's down projection (split-K partials summed and rounded as the norm would) into
    # the residual stream: one launch under PDL, not torch's sum, cast and add
    return kernels.add_residual(x, residual)


def head(norm, hidden: torch.Tensor, weight: torch.Tensor, argmax: bool, keep_rows: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 logits [N, vocab] of hidden [N, H] through the final RMSNorm `norm`; with `argmax`,
    also each row's argmax (int64 [N]) where our LM-head kernel runs: reduced in its epilogue and
    merged in one small launch instead of a second pass over the fp32 logits
    (`kernels.decode_linear(..., argmax=)`); else None (cuBLAS ran: the caller takes it).
    `keep_rows` (with `argmax`): integer [N], the rows whose logits are read; where our kernel runs,
    the other rows' logits are left unwritten (`kernels.decode_linear(..., keep_rows=)`)."""
    from splitserve.kernels.linear import MAX_ROWS

    x = kernels.rms_norm(hidden, norm.weight, norm.eps)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.shape[0] <= MAX_ROWS:
        ids = torch.empty(x.shape[0], dtype=torch.int64, device=x.device) if argmax else None
        keep = keep_rows if argmax else None
        return kernels.decode_linear(x, weight, out_dtype=torch.float32, argmax=ids, keep_rows=keep), ids
    return F.linear(x, weight).float(), None
