"""Realistic model shapes for benchmarks, written as random-weight FTW (no download)."""

from __future__ import annotations

import dataclasses

from ftkit.runtime.models import FAMILIES
from ftkit.runtime.spec import FULL_ATTENTION, QK_NORM_HEAD, ModelSpec


def _gpt_oss(layers: int, experts: int) -> dict:
    """openai/gpt-oss-20b's and -120b's config.json: they differ in layers and experts only."""
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": layers,
        "num_local_experts": experts, "num_experts_per_tok": 4, "hidden_size": 2880, "intermediate_size": 2880,
        "vocab_size": 201088, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 4096},
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "attention_bias": True, "eos_token_id": 200002, "pad_token_id": 199999,
    }


def _deepseek_v3(**changes: object) -> dict:
    """deepseek-ai/DeepSeek-V3's config.json (R1 and V3.1 share its shapes); Kimi-K2 changes the
    expert count, heads, dense layers, groups, vocabulary and rope."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 61,
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "vocab_size": 129280,
        "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, **changes,
    }


PRESETS: dict[str, ModelSpec] = {
    # 48 layers, 128 experts of 9.44 MB (bf16), top-8
    "qwen3-30b-a3b": ModelSpec(
        family="qwen3_moe", architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, top_k=8, moe_layers=tuple(range(48)),
        layer_kinds=(FULL_ATTENTION,) * 48, norm_topk_prob=True, qk_norm=QK_NORM_HEAD,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
    ),
    # 32 layers, 8 experts of 352 MB (bf16), top-2
    "mixtral-8x7b": ModelSpec(
        family="mixtral", architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=4096,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=0,
        moe_intermediate_size=14336, num_experts=8, top_k=2, moe_layers=tuple(range(32)),
        layer_kinds=(FULL_ATTENTION,) * 32, norm_topk_prob=True, rms_norm_eps=1e-5, rope_theta=1e6,
        max_position_embeddings=32768,
    ),
    # 48 layers, 3 of every 4 linear attention (recurrent state), 512 experts of 6.29 MB (bf16),
    # top-10 and a shared expert: from the published config, through the family's own parser
    "qwen3-next-80b-a3b": FAMILIES["qwen3_next"].spec_from_config({
        "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 5120, "vocab_size": 151936,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "num_experts": 512,
        "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "full_attention_interval": 4,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rope_theta": 1e7, "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "architectures": ["Qwen3NextForCausalLM"]}),
    # 40 layers, 3 of every 4 gated DeltaNet, 256 experts of 6.29 MB (bf16), top-8 and a shared
    # expert, the multimodal checkpoint's language model: transformers' Qwen3.5-35B-A3B defaults
    "qwen3.5-35b-a3b": FAMILIES["qwen3_5_moe"].spec_from_config({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": {
            "num_hidden_layers": 40, "hidden_size": 2048, "vocab_size": 248320, "num_attention_heads": 16,
            "num_key_value_heads": 2, "head_dim": 256, "num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10, "full_attention_interval": 4,
            "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
            "max_position_embeddings": 262144, "tie_word_embeddings": False}}),
    # 24 layers alternating sliding-window (128) and full attention, 32 experts of 49.8 MB (bf16),
    # top-4, expert biases and the clamped SwiGLU: from the published config, through the family
    "gpt-oss-20b": FAMILIES["gpt_oss"].spec_from_config(_gpt_oss(24, 32)),
    # the same layers, 36 of them with 128 experts each
    "gpt-oss-120b": FAMILIES["gpt_oss"].spec_from_config(_gpt_oss(36, 128)),
    # 61 layers (the first 3 dense), 256 experts of 88 MB (bf16) in 8 groups (4 kept), top-8, a
    # shared expert; MLA: 128 heads over a 512-wide latent, 576 cached values a position and layer
    "deepseek-v3": FAMILIES["deepseek_v3"].spec_from_config(_deepseek_v3()),
    # moonshotai/Kimi-K2-Instruct: 384 experts in one group, 64 heads, one dense layer
    "kimi-k2": FAMILIES["deepseek_v3"].spec_from_config(_deepseek_v3(
        n_routed_experts=384, num_attention_heads=64, num_key_value_heads=64, first_k_dense_replace=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.827, vocab_size=163840, max_position_embeddings=131072,
        rope_theta=50000.0, bos_token_id=163584, eos_token_id=163585,
        rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                      "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # small enough for CI: the qwen3 layout at toy sizes
    "tiny": ModelSpec(
        family="qwen3_moe", architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=128,
        num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
        moe_intermediate_size=64, num_experts=16, top_k=4, moe_layers=(0, 1, 2, 3),
        layer_kinds=(FULL_ATTENTION,) * 4, norm_topk_prob=True, qk_norm=QK_NORM_HEAD,
        max_position_embeddings=20000,
    ),
}


def preset_spec(name: str, layers: int | None = None) -> ModelSpec:
    """A preset, optionally cut to its first `layers` layers to fit the disk at hand (at least one
    MoE layer: DeepSeek-V3's first three are dense)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    spec = PRESETS[name]
    if layers is None or layers == spec.num_layers:
        return spec
    lo = spec.moe_layers[0] + 1
    if not lo <= layers <= spec.num_layers:
        raise ValueError(f"--layers must be in {lo}..{spec.num_layers}")
    return dataclasses.replace(
        spec, num_layers=layers, layer_kinds=spec.layer_kinds[:layers],
        moe_layers=tuple(i for i in spec.moe_layers if i < layers),
    )
