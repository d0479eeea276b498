"""`ModelConfig`: the shape of a checkpoint, read from its `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about a decoder-only checkpoint."""

    family: str
    """`llama` (also Mistral without sliding window) or `qwen2`."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "model"

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token summed over layers, at 2 bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        family = None
        for arch in cfg.get("architectures") or []:
            family = SUPPORTED_ARCHITECTURES.get(arch)
            if family is None:
                raise ValueError(
                    f"unsupported architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
                )
        if family is None:
            family = _MODEL_TYPES.get(cfg.get("model_type", ""))
        if family is None:
            raise ValueError(f"unsupported model_type {cfg.get('model_type')!r}; supported: {sorted(_MODEL_TYPES)}")
        if cfg.get("use_sliding_window") or (family == "llama" and cfg.get("sliding_window")):
            raise ValueError("sliding-window attention is not supported yet")
        if family == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
            raise ValueError("attention_bias / mlp_bias on Llama (biased o_proj / MLP) is not supported yet")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu'")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2",
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else rope,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{str(path)!r} is not a Hugging Face checkpoint: no config.json")
        try:
            cfg = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{str(config_file)!r} is not valid JSON: {exc}") from None
        return cls.from_dict(cfg, name=path.resolve().name)
