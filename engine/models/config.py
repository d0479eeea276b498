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
    "NemotronHForCausalLM": "nemotron_h",
}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "nemotron_h": "nemotron_h"}
# NemotronH layer kinds -> ours. "moe" layers are not supported yet.
_HYBRID_LAYER_TYPES = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp"}
_HYBRID_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


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
    # ---- hybrid (Mamba2 + attention + MLP) models; empty / unused for Llama-family ones
    layer_types: tuple[str, ...] = ()
    """Per global layer: `mamba`, `attention` or `mlp` (hybrid families); `()` for
    decoder-only families, where every layer is attention + MLP."""
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    ssm_state_size: int = 0
    """N: state size per head (B and C have N channels per group)."""
    mamba_num_groups: int = 0
    """G: B/C groups; head h reads group h // (mamba_num_heads // G)."""
    conv_kernel: int = 0
    """Width K of the causal depthwise conv; the conv state keeps the last K - 1 inputs."""
    mamba_chunk_size: int = 128
    """Chunk length of the chunked SSD scan (prefill)."""
    time_step_min: float = 0.0
    """Lower clamp of dt after softplus (NemotronH's `time_step_limit = (time_step_min, inf)`)."""
    use_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mlp_bias: bool = False
    attention_bias: bool = False
    mlp_act: str = "silu"
    """`silu` (gated Llama MLP) or `relu2` (NemotronH: up -> relu^2 -> down)."""

    @property
    def is_hybrid(self) -> bool:
        return bool(self.layer_types)

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the conv: x (d_inner) | B (G*N) | C (G*N)."""
        return self.mamba_d_inner + 2 * self.mamba_num_groups * self.ssm_state_size

    def attention_layer_ids(self) -> list[int]:
        """Global indices of the layers that own KV (all of them for decoder-only families)."""
        if not self.layer_types:
            return list(range(self.num_layers))
        return [i for i, t in enumerate(self.layer_types) if t == "attention"]

    def mamba_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "mamba"]

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache (the handoff layout's `num_layers`)."""
        return len(self.attention_layer_ids())

    def kv_layer_range(self, layer_start: int, layer_end: int) -> tuple[int, int]:
        """KV-layer indices [start, end) of the global layers [layer_start, layer_end)."""
        ids = self.attention_layer_ids()
        return sum(1 for i in ids if i < layer_start), sum(1 for i in ids if i < layer_end)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token summed over layers, at 2 bytes per element."""
        return 2 * self.num_kv_layers * self.num_kv_heads * self.head_dim * 2

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
        if family == "nemotron_h":
            return _nemotron_h(cfg, name)
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


def _nemotron_h(cfg: dict[str, Any], name: str) -> ModelConfig:
    """NemotronH (`transformers.models.nemotron_h`): Mamba2, attention (no RoPE) and
    relu^2 MLP layers in the pattern `layers_block_type` (or `hybrid_override_pattern`)."""
    raw = cfg.get("layers_block_type")
    if raw is None and cfg.get("hybrid_override_pattern"):
        raw = [_HYBRID_PATTERN.get(c, c) for c in cfg["hybrid_override_pattern"]]
    if not raw:
        raise ValueError("nemotron_h config has no layers_block_type / hybrid_override_pattern")
    bad = sorted({t for t in raw if t not in _HYBRID_LAYER_TYPES})
    if bad:
        raise ValueError(f"unsupported NemotronH layer type(s) {bad}; supported: {sorted(_HYBRID_LAYER_TYPES)}")
    if cfg.get("mlp_hidden_act", "relu2") != "relu2" or cfg.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError(
            f"unsupported activations mlp={cfg.get('mlp_hidden_act')!r} mamba={cfg.get('mamba_hidden_act')!r}; "
            "only relu2 / silu"
        )
    if cfg.get("sliding_window"):
        raise ValueError("sliding-window attention is not supported yet")
    biased = [k for k in ("attention_bias", "mlp_bias", "use_bias") if cfg.get(k)]
    if biased:  # a bias after a row-split projection would be added once per TP rank
        raise ValueError(f"NemotronH with {biased} is not supported yet")
    layer_types = tuple(_HYBRID_LAYER_TYPES[t] for t in raw)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    heads, groups = int(cfg["mamba_num_heads"]), int(cfg.get("n_groups", 1))
    if heads % groups:
        raise ValueError(f"mamba_num_heads {heads} is not a multiple of n_groups {groups}")
    return ModelConfig(
        family="nemotron_h",
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=len(layer_types),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        intermediate_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        rope_theta=0.0,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=name,
        layer_types=layer_types,
        mamba_num_heads=heads,
        mamba_head_dim=int(cfg["mamba_head_dim"]),
        ssm_state_size=int(cfg["ssm_state_size"]),
        mamba_num_groups=groups,
        conv_kernel=int(cfg.get("conv_kernel", 4)),
        mamba_chunk_size=int(cfg.get("chunk_size", 128)),
        time_step_min=float(cfg.get("time_step_min", 0.0)),
        use_conv_bias=bool(cfg.get("use_conv_bias", True)),
        mamba_proj_bias=bool(cfg.get("use_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_act="relu2",
    )
