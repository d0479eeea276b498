"""Load a Hugging Face checkpoint (safetensors only, single or sharded) into one
rank's `CausalLM`, slicing tensor-parallel shards and skipping other stages' layers.

Pickle checkpoints (`*.bin`, `*.pt`) are refused: loading them runs code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from splitserve.engine.models.llama import CausalLM
from splitserve.engine.parallel import kv_heads_of_rank

_LAYER = re.compile(r"^(?:model|backbone)\.layers\.(\d+)\.(.+)$")
_PREFIXES = ("model.", "backbone.")  # Llama-family / NemotronH checkpoints


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


def load_weights(model: CausalLM, path: str | Path, dtype: torch.dtype, device: torch.device) -> None:
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for file in checkpoint_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                local = _local_name(name, model)
                if local is None or local.endswith("rotary_emb.inv_freq"):
                    continue
                if local not in params:
                    if not _is_other_stage(local, model):
                        unexpected.append(name)
                    continue
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
                param = params[local]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(param.shape)} for this rank"
                    )
                param.data = tensor.to(device=device, dtype=dtype)
                loaded.add(local)
    if unexpected:
        raise ValueError(f"checkpoint {str(path)!r} has weights this model does not use: {unexpected[:5]}")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} lacks weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    # Buffers stay as built (the rotary inverse frequencies remain float32, as in HF).
    model.eval()


def _is_other_stage(local: str, model: CausalLM) -> bool:
    """Embedding / final norm / lm_head tensors that another pipeline stage owns."""
    return local.split(".")[0] in ("embed_tokens", "norm", "lm_head", "embeddings", "norm_f")
