"""Small models of the decoder families, built by transformers' own classes from their config classes, with every
quirk of the released sizes kept at toy scale: head_dim != hidden / heads, grouped-query attention, a sliding window
shorter than the sequence, soft-caps that bite, rotary scaling whose factors matter at these lengths, latent
attention ranks, grouped routing with a non-zero balancing bias."""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=False)
"""Every family's toy shape (vocab above the byte tokenizer's 257)."""

FAMILIES = {
    # Llama 3.1's rotary scaling with a short "original" context, so every band of the rule is in use; head_dim 12
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=12, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    # biases on q, k, v; YaRN (Qwen2.5's long-context setting); tied embeddings (the small Qwen2.5 sizes)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16})),
    # head_dim 16 with hidden 32 / 4 heads (Qwen3-0.6B: 1024 / 16 heads of 128); linear scaling
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    # every Gemma 2 quirk: GeGLU, (1 + w) norms around both sub-layers, sqrt(d) embeddings, soft-caps small enough
    # to bite, a query scale of its own, local (window 5) and global layers, head_dim != hidden / heads, tied head
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=5, attn_logit_softcapping=1.5,
        final_logit_softcapping=2.5, tie_word_embeddings=True)),
    # Gemma 3: QK-norm, two local layers then a global one, the local layers' own unscaled rotation
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=5, final_logit_softcapping=2.5,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], tie_word_embeddings=True,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # fused qkv and gate_up tensors, half of each head rotated, a sliding window (Phi-3-mini's 2047, here 5)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=5, pad_token_id=0, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # latent attention (q rank 16, kv rank 12, 8 + 4 rotary query-key dims, values of 6), YaRN with mscale (the
    # softmax scale then carries mscale^2), one dense block then MoE blocks of 8 experts in 4 groups (top 2 groups,
    # top 2 experts), a shared expert, the gate scale
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        first_k_dense_replace=1, moe_intermediate_size=12, n_shared_experts=1, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "beta_fast": 32, "beta_slow": 1})),
}
"""model_type -> (config class, model class, what differs from :data:`BASE`)."""


def family_model(kind: str, **overrides):
    """The transformers model of family ``kind`` with random weights (N(0, 0.2), norms around their own
    values, the routers' balancing biases non-zero), in eval mode."""
    import transformers

    config_class, model_class, extra = FAMILIES[kind]
    config = getattr(transformers, config_class)(**{**BASE, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if name.endswith("norm.weight") else 0.2)
                    + (1.0 if name.endswith("norm.weight") and not kind.startswith("gemma") else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model.eval()


def family_directory(kind: str, path: Path, **overrides) -> Path:
    """:func:`family_model` saved by ``save_pretrained`` (the Hub layout) into ``path``."""
    family_model(kind, **overrides).save_pretrained(path)
    return path
