"""Named model sizes.

Pure data (no torch import) so that config validation and the planner can use it
without building a model. A preset fills every model field the user left unset;
fields given explicitly (``--model.n_layers 6``) win over the preset.

Sources for the published shapes:
  * GPT-2: Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", Table 2
    (the 124M/350M/1.5B sizes as released; 1.5B uses 25 heads of 64).
  * GPT-3 175B: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1.
  * llama-1b: the TinyLlama 1.1B shape (Zhang et al. 2024), a Llama-2 architecture.
  * llama-8b: Llama 3 8B (Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 3).

``vocab_size=None`` means "take it from the tokenizer" (the small CPU presets).
The large presets are for planning; building them allocates their full size.
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # A model small enough for multi-process unit tests on a 2-core CPU.
    "tiny": dict(flavor="gpt2", n_layers=2, d_model=64, n_heads=4, max_seq_len=64),
    "tiny-llama": dict(flavor="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, max_seq_len=64),
    # The default of `shardwise train`: learns visible Python structure in ~3 minutes on 2 CPU cores.
    "cpu-demo": dict(flavor="gpt2", n_layers=4, d_model=256, n_heads=8, max_seq_len=128),
    # Mixture of experts (shardwise.model.moe): 4 experts top-2, for multi-process tests; a CPU demo with
    # the active FLOPs of cpu-demo (top-2 of 8 experts of half cpu-demo's MLP width); Mixtral-8x7B's shape for
    # the planner (Jiang et al. 2024, "Mixtral of Experts", Table 1: 46.7B total, 12.9B active parameters).
    "tiny-moe": dict(flavor="gpt2", n_layers=2, d_model=64, n_heads=4, max_seq_len=64, n_experts=4, d_ff=128),
    "cpu-demo-moe": dict(flavor="gpt2", n_layers=4, d_model=256, n_heads=8, max_seq_len=128, n_experts=8, d_ff=512),
    "mixtral-8x7b": dict(
        flavor="llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
        vocab_size=32000, max_seq_len=32768, rope_theta=1e6, n_experts=8,
    ),
    "gpt2-124m": dict(flavor="gpt2", n_layers=12, d_model=768, n_heads=12, vocab_size=50257, max_seq_len=1024),
    "gpt2-350m": dict(flavor="gpt2", n_layers=24, d_model=1024, n_heads=16, vocab_size=50257, max_seq_len=1024),
    "gpt2-1.5b": dict(flavor="gpt2", n_layers=48, d_model=1600, n_heads=25, vocab_size=50257, max_seq_len=1024),
    "llama-1b": dict(
        flavor="llama", n_layers=22, d_model=2048, n_heads=32, n_kv_heads=4, d_ff=5632,
        vocab_size=32000, max_seq_len=2048, rope_theta=10000.0,
    ),
    "llama-8b": dict(
        flavor="llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, d_ff=14336,
        vocab_size=128256, max_seq_len=8192, rope_theta=500000.0,
    ),
    "gpt3-175b": dict(flavor="gpt2", n_layers=96, d_model=12288, n_heads=96, vocab_size=50257, max_seq_len=2048),
}

# "custom" means: no preset, every required field is given explicitly.
PRESET_NAMES = ("custom", *PRESETS)
