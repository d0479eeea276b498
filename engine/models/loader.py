"""Load a Hugging Face checkpoint (safetensors only, single or sharded) into one
rank's `CausalLM`, slicing tensor-parallel shards and skipping other stages' layers.

Pickle checkpoints (`*.bin`, `*.pt`) are refused: loading them runs code.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.engine.models.llama import CausalLM
from splitserve.engine.parallel import kv_heads_of_rank

_LAYER = re.compile(r"^(?:model|backbone)\.layers\.(\d+)\.(.+)$")
_PREFIXES = ("model.", "backbone.")  # Llama-family / NemotronH checkpoints
PROGRESS_MIN_BYTES = 1 << 30
"""Checkpoints this large or larger (all their files) show a progress bar while they load."""
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2}  # anything else (int8, fp8, bool): 1


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {pickles[0]}: pickle checkpoints are not loaded; convert to safetensors)" if pickles else ""
        raise FileNotFoundError(f"no *.safetensors weights in {str(path)!r}{hint}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint shard(s) missing: {missing}")
    return files


def _shard(name: str, model: CausalLM) -> tuple[int, slice | torch.Tensor] | None:
    """(dim, slice or index tensor) of the full tensor this rank keeps, or None for a replicated one."""
    ps, cfg = model.ps, model.cfg
    if ps.tp_size == 1:
        return None
    if cfg.is_hybrid:
        from splitserve.engine.models.hybrid_shard import hybrid_shard

        special = hybrid_shard(name, cfg, ps)
        if special is not False:
            return special
    d = cfg.head_dim
    if ".q_proj." in name:
        per = cfg.num_heads // ps.tp_size
        return 0, slice(ps.tp_rank * per * d, (ps.tp_rank + 1) * per * d)
    if ".k_proj." in name or ".v_proj." in name:
        start, end = kv_heads_of_rank(cfg.num_kv_heads, ps.tp_size, ps.tp_rank)
        return 0, slice(start * d, end * d)
    if ".o_proj." in name:
        per = cfg.num_heads // ps.tp_size
        return 1, slice(ps.tp_rank * per * d, (ps.tp_rank + 1) * per * d)
    per = cfg.intermediate_size // ps.tp_size
    if ".gate_proj." in name or ".up_proj." in name:
        return 0, slice(ps.tp_rank * per, (ps.tp_rank + 1) * per)
    if ".down_proj." in name:
        return 1, slice(ps.tp_rank * per, (ps.tp_rank + 1) * per)
    return None


def _local_name(name: str, model: CausalLM) -> str | None:
    """Map a checkpoint tensor name to this rank's parameter name (None: not ours)."""
    m = _LAYER.match(name)
    if m:
        layer = int(m.group(1))
        if not model.layer_start <= layer < model.layer_end:
            return None
        return f"layers.{layer - model.layer_start}.{m.group(2)}"
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _progress(files: list[Path], model: CausalLM):
    """A bar in bytes of checkpoint tensors read (skipped ones too, so it ends at 100%) on stderr:
    shown by the first rank for checkpoints of `PROGRESS_MIN_BYTES` or more when stderr is a
    terminal; `SPLITSERVE_PROGRESS=1` / `0` forces it on / off (logs, tests)."""
    from tqdm import tqdm

    total = sum(f.stat().st_size for f in files)
    forced = os.environ.get("SPLITSERVE_PROGRESS")
    show = forced == "1" or (forced != "0" and total >= PROGRESS_MIN_BYTES and model.ps.rank == 0
                             and sys.stderr.isatty())  # fmt: skip
    return tqdm(total=total, desc="loading weights", unit="B", unit_scale=True, unit_divisor=1024,
                disable=not show, file=sys.stderr)  # fmt: skip


def _tensor_bytes(f, name: str) -> int:
    view = f.get_slice(name)
    size = _DTYPE_BYTES.get(view.get_dtype(), 1)
    for dim in view.get_shape():
        size *= dim
    return size


def load_weights(model: CausalLM, path: str | Path, dtype: torch.dtype, device: torch.device) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    files = checkpoint_files(Path(path))
    with _progress(files, model) as bar:
        for file in files:
            _load_file(file, model, params, dtype, device, loaded, unexpected, bar)
        bar.update(bar.total - bar.n)  # the files' headers
    if unexpected:
        raise ValueError(f"checkpoint {str(path)!r} has weights this model does not use: {unexpected[:5]}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    # Buffers stay as built (the rotary inverse frequencies remain float32, as in HF).
    model.eval()


def _load_file(file: Path, model: CausalLM, params: dict, dtype: torch.dtype, device: torch.device, loaded: set[str],
               unexpected: list[str], bar) -> None:  # fmt: skip
    """This rank's tensors of one checkpoint file into `params` (names added to `loaded`)."""
    with safe_open(str(file), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            local = _local_name(name, model)  # None: another stage's layer
            if local in params:
                params[local].data = _read(f, name, model, params[local]).to(device=device, dtype=dtype)
                loaded.add(local)
            elif local is not None and not local.endswith("rotary_emb.inv_freq") and not _is_other_stage(local, model):
                unexpected.append(name)
            if not bar.disable:
                bar.update(_tensor_bytes(f, name))


def _read(f, name: str, model: CausalLM, param: torch.Tensor) -> torch.Tensor:
    """Checkpoint tensor `name` as this rank keeps it (its tensor-parallel shard), shape-checked."""
    shard = _shard(name, model)
    if shard is None:
        tensor = f.get_tensor(name)
    else:
        dim, sl = shard
        if isinstance(sl, torch.Tensor):  # a gather of non-contiguous rows (mamba in_proj, conv)
            tensor = f.get_tensor(name).index_select(dim, sl)
        else:
            view = f.get_slice(name)
            tensor = view[sl] if dim == 0 else view[:, sl]
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)} for this rank"
        )
    return tensor


def _is_other_stage(local: str, model: CausalLM) -> bool:
    """Embedding / final norm / lm_head tensors that another pipeline stage owns."""
    return local.split(".")[0] in ("embed_tokens", "norm", "lm_head", "embeddings", "norm_f")
