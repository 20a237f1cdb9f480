"""The one model configuration, read from a Hugging Face Qwen3.5 `config.json`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

LINEAR = "linear_attention"
FULL = "full_attention"


class ConfigError(ValueError):
    """A model folder whose config we cannot compile; the message names the field."""


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    model_type = raw.get("model_type")
    if model_type == "qwen3_5":
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError("config.json: model_type 'qwen3_5' needs a 'text_config' object")
        text = dict(raw["text_config"])
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        return text
    if model_type == "qwen3_5_text":
        return dict(raw)
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        raise ConfigError(f"config.json: model_type '{model_type}' (MoE) is not supported")
    raise ConfigError(
        f"config.json: model_type must be 'qwen3_5' or 'qwen3_5_text', got {model_type!r}"
    )


def _field(cfg: dict[str, Any], name: str, kind: type) -> Any:
    if name not in cfg:
        raise ConfigError(f"config.json: missing field '{name}'")
    value = cfg[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ConfigError(f"config.json: field '{name}' must be {kind.__name__}, got {value!r}")
    if kind is int and value <= 0:
        raise ConfigError(f"config.json: field '{name}' must be positive, got {value}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a Qwen3.5 language model (the text tower only)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    tie_word_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        cfg = _text_config(raw)
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            raise ConfigError("config.json: field 'num_experts' is set: MoE is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(
                f"config.json: field 'hidden_act' must be 'silu', got {cfg['hidden_act']!r}"
            )
        if cfg.get("attention_bias", False):
            raise ConfigError("config.json: field 'attention_bias' must be false")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(
                f"config.json: rope_parameters.rope_type {rope_type!r} is not supported"
            )
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta"))
        if rope_theta is None:
            raise ConfigError("config.json: missing field 'rope_parameters.rope_theta'")
        partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
        num_layers = _field(cfg, "num_hidden_layers", int)
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = cfg.get("full_attention_interval", 4)
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(num_layers)]
        config = cls(
            vocab_size=_field(cfg, "vocab_size", int),
            hidden_size=_field(cfg, "hidden_size", int),
            intermediate_size=_field(cfg, "intermediate_size", int),
            num_hidden_layers=num_layers,
            num_attention_heads=_field(cfg, "num_attention_heads", int),
            num_key_value_heads=_field(cfg, "num_key_value_heads", int),
            head_dim=_field(cfg, "head_dim", int),
            linear_conv_kernel_dim=_field(cfg, "linear_conv_kernel_dim", int),
            linear_key_head_dim=_field(cfg, "linear_key_head_dim", int),
            linear_value_head_dim=_field(cfg, "linear_value_head_dim", int),
            linear_num_key_heads=_field(cfg, "linear_num_key_heads", int),
            linear_num_value_heads=_field(cfg, "linear_num_value_heads", int),
            layer_types=tuple(layer_types),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        )
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf(json.loads(Path(path).read_text()))

    def validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"config.json: field 'layer_types' has {len(self.layer_types)} entries "
                f"but num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = set(self.layer_types) - {LINEAR, FULL}
        if unknown:
            raise ConfigError(
                f"config.json: field 'layer_types' has unknown kinds {sorted(unknown)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                "config.json: field 'num_attention_heads' must be a multiple of "
                "'num_key_value_heads'"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                "config.json: field 'linear_num_value_heads' must be a multiple of "
                "'linear_num_key_heads'"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(
                f"config.json: field 'partial_rotary_factor' {self.partial_rotary_factor} gives an "
                f"invalid rotary dim {self.rotary_dim} for head_dim {self.head_dim}"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF tensor names (without the `model.`/`model.language_model.` prefix) and shapes."""
        h, d = self.hidden_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "embed_tokens.weight": (self.vocab_size, h),
            "norm.weight": (h,),
        }
        for i, kind in enumerate(self.layer_types):
            p = f"layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
            if kind == FULL:
                a = p + "self_attn."
                shapes[a + "q_proj.weight"] = (2 * self.num_attention_heads * d, h)
                shapes[a + "k_proj.weight"] = (self.num_key_value_heads * d, h)
                shapes[a + "v_proj.weight"] = (self.num_key_value_heads * d, h)
                shapes[a + "o_proj.weight"] = (h, self.num_attention_heads * d)
                shapes[a + "q_norm.weight"] = (d,)
                shapes[a + "k_norm.weight"] = (d,)
            else:
                g = p + "linear_attn."
                hv = self.linear_num_value_heads
                shapes[g + "in_proj_qkv.weight"] = (self.conv_dim, h)
                shapes[g + "in_proj_z.weight"] = (self.value_dim, h)
                shapes[g + "in_proj_b.weight"] = (hv, h)
                shapes[g + "in_proj_a.weight"] = (hv, h)
                shapes[g + "conv1d.weight"] = (self.conv_dim, 1, self.linear_conv_kernel_dim)
                shapes[g + "dt_bias"] = (hv,)
                shapes[g + "A_log"] = (hv,)
                shapes[g + "norm.weight"] = (self.linear_value_head_dim,)
                shapes[g + "out_proj.weight"] = (h, self.value_dim)
        return shapes

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layer_types"] = list(self.layer_types)
        return out
