"""Transformer language models in three flavours, as plain single-device PyTorch.

* ``flavor="gpt2"`` — Radford et al. 2019, "Language Models are Unsupervised Multitask Learners"
  §2.3: pre-norm blocks with LayerNorm (with bias), GELU MLP, learned absolute position embeddings,
  a final LayerNorm, biases in every linear layer, output head tied to the token embedding.
* ``flavor="llama"`` — Touvron et al. 2023, "LLaMA" §2.2: pre-norm blocks with RMSNorm, SwiGLU MLP,
  rotary position embeddings, grouped-query attention (``n_kv_heads``), no biases, untied head; with
  ``qk_norm`` an RMSNorm over each query and key head before the rotation (Qwen3; Dehghani et al. 2023,
  "Scaling Vision Transformers to 22 Billion Parameters", §3.1).
* ``flavor="bert"`` — Devlin et al. 2019, "BERT" §3 (the released code's layout): an encoder with
  bidirectional attention (padding masks), learned position and token-type embeddings summed and
  LayerNorm-ed, *post*-norm blocks (``norm(x + sublayer(x))``, Vaswani et al. 2017 §3.1) with the
  exact GELU, and the masked-language-model head (dense, GELU, LayerNorm, then the output projection
  tied to the token embedding, with a bias) -- or, with ``n_classes``, the sequence classifier on the
  first ([CLS]) position (pooler: dense + tanh, then a linear layer; Devlin et al. 2019 §4.1). The last
  three vocabulary ids are bert's [PAD], [CLS] and [MASK] (:func:`bert_special_ids`); keys at [PAD]
  are masked out of attention when classifying.

``model.blocks[i].forward(x) -> x`` takes and returns one ``[B, T, d_model]`` tensor, so blocks can
be wrapped (activation checkpointing) or distributed (pipeline stages) from outside.

Initialisation (:meth:`Transformer.reset_parameters`) follows GPT-2 / nanoGPT: N(0, init_std) for
linear and embedding weights, zeros for biases, ones for norm gains, and the residual output
projections (``o_proj``, ``fc_out``, ``down_proj``) scaled by 1/sqrt(2 * n_layers) (Radford et al.
2019, §2.3). Each parameter's value depends only on (seed, its canonical name, its shape) — never on
the global RNG, the device, or which other parameters exist — so any layout builds the same model.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.model.dropout import Dropout, DropoutKey
from shardwise.model.layers import Attention, GeluMLP, RMSNorm, SwiGLU
from shardwise.model.mla import LatentAttention
from shardwise.model.moe import MoE, is_moe_layer, moe_aux_loss, moe_layers
from shardwise.model.rope import RotaryEmbedding
from shardwise.model.rope_scaling import parse_rope_scaling, softmax_scale_factor
from shardwise.model.router import Router
from shardwise.model.scores import ScoreRule

if TYPE_CHECKING:
    from shardwise.config import ModelConfig

TOKEN_TYPES = 2
"""bert's token-type (segment) embedding rows: sentence A and B (Devlin et al. 2019 §3.2)."""
RESIDUAL_OUTPUTS = frozenset({"o_proj", "fc_out", "down_proj"})
"""Linear layers that write into the residual stream; their init is scaled by 1/sqrt(2*n_layers)."""

_REQUIRED = ("flavor", "n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "max_seq_len")


NORM_PLACEMENTS = ("pre", "sandwich", "post")
"""``model.norm_placement`` (mirrored, without torch, in :data:`shardwise.config.NORM_PLACEMENTS`)."""


def _norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    if cfg.flavor in ("gpt2", "bert"):
        return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=True)
    return RMSNorm(dim or cfg.d_model, eps=cfg.norm_eps, unit_offset=getattr(cfg, "norm_unit_offset", False))


def head_dim_of(cfg) -> int:
    """The width of an attention head: ``model.head_dim``, or ``d_model / n_heads``."""
    return getattr(cfg, "head_dim", None) or cfg.d_model // cfg.n_heads


def is_sliding_layer(layer_id: int, window: int, global_every: int) -> bool:
    """Whether block ``layer_id`` attends within a sliding window: every block with ``window > 0``, except the
    last of each run of ``global_every`` blocks (Gemma 2: every other block; Gemma 3: five of six)."""
    return window > 0 and (global_every <= 0 or (layer_id + 1) % global_every != 0)


def score_rule(cfg: ModelConfig, layer_id: int) -> ScoreRule:
    """Block ``layer_id``'s attention scores (:class:`~shardwise.model.scores.ScoreRule`): the query scale of
    ``attn_scale_dim``, its sliding window, the soft-cap."""
    window = cfg.sliding_window if is_sliding_layer(layer_id, cfg.sliding_window, cfg.sliding_global_every) else 0
    scale = cfg.attn_scale_dim ** -0.5 if cfg.attn_scale_dim else None
    return ScoreRule(scale=scale, window=window, softcap=cfg.attn_softcap)


def _attention(cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding | None, gelu: bool, causal: bool) -> Attention:
    if cfg.kv_lora_rank:  # DeepSeek's multi-head latent attention
        scale, head_dim = softmax_scale_factor(parse_rope_scaling(cfg.rope_scaling)), head_dim_of(cfg)
        return LatentAttention(cfg.d_model, cfg.n_heads, q_rank=cfg.q_lora_rank, kv_rank=cfg.kv_lora_rank,
                               nope_dim=head_dim - cfg.rope_dim, rope_dim=cfg.rope_dim,
                               v_dim=cfg.v_head_dim or head_dim, rope=rope, eps=cfg.norm_eps, layer=layer_id,
                               dropout=cfg.dropout, scale_factor=scale)
    return Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, bias=gelu, dropout=cfg.dropout, rope=rope,
                     causal=causal, layer=layer_id, qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None,
                     head_dim=head_dim_of(cfg), qkv_bias=cfg.qkv_bias, rule=score_rule(cfg, layer_id),
                     qk_norm_scope=cfg.qk_norm_scope, unit_offset=cfg.norm_unit_offset)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``, with dropout on
    both residual branches (Radford et al. 2019 §2.3; Xiong et al. 2020 for the pre-norm layout); for
    bert post-norm, ``norm1(x + attn(x))`` then ``norm2(x + mlp(x))`` (Vaswani et al. 2017 §3.1).

    ``model.norm_placement`` moves the llama flavour's norms: "sandwich" normalises each sub-layer's output
    too, ``x + post_norm1(attn(norm1(x)))`` (Gemma 2 and 3, Gemma Team 2024 §2), and "post" normalises only
    the output, ``x + norm1(attn(x))`` (OLMo 2, Team OLMo 2024 §3.1). The attention is a latent one with
    ``model.kv_lora_rank`` (:mod:`shardwise.model.mla`); the feed-forward a mixture of experts in the blocks
    :func:`~shardwise.model.moe.is_moe_layer` names.

    ``layer_id`` is the block's index in the full model; it names the block's parameters for
    initialisation and keys its dropout masks (:mod:`shardwise.model.dropout`), so a process holding only some
    blocks initialises them identically and draws the same masks.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding | None = None,
                 rope_local: RotaryEmbedding | None = None):
        super().__init__()
        gelu, self.post_norm = cfg.flavor in ("gpt2", "bert"), cfg.flavor == "bert"
        self.placement = "pre" if gelu else cfg.norm_placement
        self.layer_id = layer_id
        if rope_local is not None and is_sliding_layer(layer_id, cfg.sliding_window, cfg.sliding_global_every):
            rope = rope_local  # Gemma 3: the local layers' own rotation
        self.norm1 = _norm(cfg)
        self.attn = _attention(cfg, layer_id, rope, gelu, causal=not self.post_norm)
        self.norm2 = _norm(cfg)
        if self.placement == "sandwich":
            self.post_norm1, self.post_norm2 = _norm(cfg), _norm(cfg)
        if is_moe_layer(layer_id, cfg.n_experts or 0, cfg.moe_every, cfg.moe_dense_first):
            self.mlp = MoE(cfg.d_model, cfg.d_ff, cfg.flavor, cfg.n_experts, cfg.moe_top_k, n_shared=cfg.moe_shared,
                           capacity_factor=cfg.moe_capacity_factor, aux_coeff=cfg.moe_aux_coeff,
                           z_coeff=cfg.moe_z_coeff, router=cfg.moe_router, bias_rate=cfg.moe_bias_rate,
                           layer_id=layer_id, d_expert=cfg.moe_d_ff, groups=cfg.moe_groups,
                           group_top_k=cfg.moe_group_top_k, gate_scale=cfg.moe_gate_scale)
        else:
            self.mlp = GeluMLP(cfg.d_model, cfg.d_ff, bias=True, approximate="none" if self.post_norm else "tanh") \
                if gelu else SwiGLU(cfg.d_model, cfg.d_ff, bias=False, activation=cfg.mlp_activation)
        self.drop_attn = Dropout(cfg.dropout, "attn_out", layer_id)
        self.drop_mlp = Dropout(cfg.dropout, "mlp_out", layer_id)

    def forward(self, x: torch.Tensor, cache=None, padding_mask: torch.Tensor | None = None,
                dropout_key: DropoutKey | None = None) -> torch.Tensor:
        key = dropout_key
        if self.post_norm:
            x = self.norm1(x + self.drop_attn(self.attn(x, padding_mask=padding_mask, dropout_key=key), key))
            return self.norm2(x + self.drop_mlp(self.mlp(x), key))
        if self.placement == "post":  # OLMo 2: the norms on the sub-layers' outputs
            attn = self.attn(x, dropout_key=key) if cache is None else self.attn(x, cache[self.layer_id])
            x = x + self.drop_attn(self.norm1(attn), key)
            return x + self.drop_mlp(self.norm2(self.mlp(x)), key)
        h = self.norm1(x)
        attn = self.attn(h, dropout_key=key) if cache is None else self.attn(h, cache[self.layer_id])
        if self.placement == "sandwich":
            x = x + self.drop_attn(self.post_norm1(attn), key)
            return x + self.drop_mlp(self.post_norm2(self.mlp(self.norm2(x))), key)
        x = x + self.drop_attn(attn, key)
        return x + self.drop_mlp(self.mlp(self.norm2(x)), key)


class Transformer(nn.Module):
    """Language model: ``embed -> blocks -> norm_f -> lm_head`` (bert: an encoder, see the module docstring).

    ``model(tokens)`` returns logits ``[B, T, vocab_size]``; ``model(tokens, targets)`` returns
    ``self.loss_fn(logits, targets)``: by default :func:`mean_cross_entropy`, the mean next-token
    cross-entropy as an fp32 scalar (targets equal to -100 are ignored); in training mode, plus the
    weighted auxiliary losses of the mixture-of-experts blocks (:mod:`shardwise.model.moe`). ``loss_fn`` is a plain
    attribute so that code outside the model can replace it (e.g. by one that takes logits split
    over the vocabulary).

    The constructor allocates on the default device (``with torch.device(...)`` is honoured) and
    calls ``reset_parameters(seed=0)``; it never touches the global RNG. Built under
    ``torch.device("meta")`` it allocates nothing and skips initialisation: materialise with
    ``model.to_empty(device=...)`` and then call ``model.reset_parameters(seed)``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        missing = [k for k in _REQUIRED if getattr(cfg, k) is None]
        if missing:
            raise ValueError(f"ModelConfig fields {missing} are unset; pass config_resolve.resolve(cfg).model")
        if cfg.flavor not in ("gpt2", "llama", "bert"):
            raise ValueError(f"model.flavor={cfg.flavor!r} is not valid; use 'gpt2', 'llama' or 'bert'")
        self.cfg = cfg
        gpt2, bert = cfg.flavor in ("gpt2", "bert"), cfg.flavor == "bert"  # gpt2: learned positions
        self.classifies = bert and bool(getattr(cfg, "n_classes", 0))
        device = torch.empty(0).device  # the default device, honouring `with torch.device(...)`
        # Build on the meta device, then allocate once and initialise with reset_parameters: this
        # skips torch's default (kaiming) init, which would consume the global RNG.
        with torch.device("meta"):
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if gpt2 else None
            self.rope = None if gpt2 else RotaryEmbedding(
                cfg.rope_dim or head_dim_of(cfg), cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling,
                interleaved=bool(cfg.kv_lora_rank))
            self.rope_local = RotaryEmbedding(cfg.rope_dim or head_dim_of(cfg), cfg.max_seq_len,
                                              cfg.rope_local_theta) if not gpt2 and cfg.rope_local_theta else None
            self.drop = Dropout(cfg.dropout, "embed")
            self.blocks = nn.ModuleList(Block(cfg, i, self.rope, self.rope_local) for i in range(cfg.n_layers))
            if bert:  # token types, the embeddings' LayerNorm
                self.type_emb = nn.Embedding(TOKEN_TYPES, cfg.d_model)
                self.emb_norm = _norm(cfg)
            if self.classifies:  # the [CLS] pooler and classifier instead of the language-model head
                self.pooler = nn.Linear(cfg.d_model, cfg.d_model)
                self.classifier = nn.Linear(cfg.d_model, cfg.n_classes)
                self.drop_classifier = Dropout(cfg.dropout, "classifier")  # on the pooled output, as BERT's
            else:
                if bert:  # the masked-LM head's transform
                    self.mlm_dense = nn.Linear(cfg.d_model, cfg.d_model)
                self.norm_f = _norm(cfg)
                self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=bert)
        self.loss_fn = mean_cross_entropy
        self.tie_weights()
        if device.type != "meta":
            self.to_empty(device=device)
            self.reset_parameters(seed=0)

    # ---- forward ----------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
              token_types: torch.Tensor | None = None, dropout_key: DropoutKey | None = None) -> torch.Tensor:
        """Token (+ learned position, gpt2 and bert) embeddings of ``tokens [B, T]`` -> ``[B, T, d_model]``, at
        positions ``0..T-1`` or ``positions [B, T]``; bert adds ``token_types [B, T]`` (default 0) and a LayerNorm;
        then dropout."""
        t = tokens.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        x = self.tok_emb(tokens)
        if self.cfg.embed_scale:  # Gemma: the embeddings times sqrt(d_model)
            x = x * torch.tensor(self.cfg.d_model ** 0.5, dtype=x.dtype)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(t, device=tokens.device) if positions is None else positions)
        if self.cfg.flavor == "bert":
            x = self.emb_norm(x + self.type_emb(torch.zeros_like(tokens) if token_types is None else token_types))
        return self.drop(x, dropout_key)

    def head(self, x: torch.Tensor, targets: torch.Tensor | None = None,
             dropout_key: DropoutKey | None = None) -> torch.Tensor:
        """Final norm and output projection; logits, or ``self.loss_fn(logits, targets)`` with ``targets``.
        (bert: the masked-LM transform ``norm_f(gelu(mlm_dense(x)))`` before the projection; classifying: the
        class logits ``classifier(tanh(pooler(x[:, 0])))`` and their mean cross-entropy against ``targets [B]``.)"""
        if self.classifies:
            logits = self.classifier(self.drop_classifier(torch.tanh(self.pooler(x[:, 0])), dropout_key))
            return logits if targets is None else F.cross_entropy(logits.float(), targets)
        if self.cfg.flavor == "bert":
            x = F.gelu(self.mlm_dense(x))
        logits = self.lm_head(self.norm_f(x))
        cap = self.cfg.final_softcap
        if cap:  # Gemma 2's final logit soft-capping (Gemma Team 2024, §2)
            logits = torch.tanh(logits / cap) * cap
        if targets is None:
            return logits
        return self.loss_fn(logits, targets)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, cache=None,
                padding_mask: torch.Tensor | None = None, token_types: torch.Tensor | None = None,
                dropout_key: DropoutKey | None = None) -> torch.Tensor:
        """Logits (or the loss with ``targets``). With ``cache`` (a :class:`~shardwise.model.kv_cache.KVCache`)
        ``tokens`` are the next tokens after those the cache holds, at the cache's positions. bert only:
        ``padding_mask [B, T]`` (True = a real token) and ``token_types [B, T]``. ``dropout_key``: the draw of
        the dropout masks in training (:mod:`shardwise.model.dropout`; without one, torch's generator draws them)."""
        if (padding_mask is not None or token_types is not None) and self.cfg.flavor != "bert":
            raise ValueError("padding_mask and token_types are for the bidirectional bert flavour")
        if self.classifies and padding_mask is None:
            padding_mask = tokens != bert_special_ids(self.cfg.vocab_size)[0]
        x = self.embed(tokens, None if cache is None else cache.positions, token_types, dropout_key)
        for block in self.blocks:
            if padding_mask is not None or (dropout_key is not None and cache is None):
                x = block(x, padding_mask=padding_mask, dropout_key=dropout_key)
            else:
                x = block(x) if cache is None else block(x, cache)
        if cache is not None:
            cache.advance()
        out = self.head(x, targets, dropout_key)
        if targets is not None and self.training and self.cfg.n_experts:
            for moe in moe_layers(self):
                moe.record()
            aux = moe_aux_loss(self)
            if aux is not None:
                out = out + aux.to(out.dtype)
        return out

    # ---- parameters -------------------------------------------------------------------------

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, counting tied weights once. ``exclude_embeddings`` leaves out the
        token and position tables (and so a head tied to the token table), as in Kaplan et al. 2020."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= sum(e.weight.numel() for e in (self.tok_emb, self.pos_emb) if e is not None)
        return n

    def named_parameters_for_init(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Each distinct parameter with its canonical name (e.g. ``blocks.3.attn.q_proj.weight``).

        Block parameters are named by the block's ``layer_id`` rather than its position in
        ``self.blocks``, and path components starting with ``_`` (wrappers such as
        ``_checkpoint_wrapped_module`` or ``_orig_mod``) are dropped, so names survive wrapping
        and partitioning.
        """
        seen: set[int] = set()
        for module in self.modules():
            if isinstance(module, Block):
                for name, p in module.named_parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        yield _canonical(f"blocks.{module.layer_id}.{name}"), p
        for name, p in self.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield _canonical(name), p

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the token embedding tensor when ``cfg.tie_embeddings`` (Press & Wolf
        2017). ``Module.to_empty`` unties shared parameters; :meth:`reset_parameters` re-ties them."""
        if self.cfg.tie_embeddings and not self.classifies and self.lm_head.weight is not self.tok_emb.weight:
            self.lm_head.weight = self.tok_emb.weight

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Initialise every parameter from ``(seed, canonical name, shape)`` only, re-tie the output
        head (if tied) and rebuild the rotary tables. Parameters on the meta device are skipped.
        See :func:`initial_value`."""
        self.tie_weights()
        for module in self.modules():
            if isinstance(module, (RotaryEmbedding, Router)):
                module.reset_parameters()
        for name, p in self.named_parameters_for_init():
            if p.is_meta:
                continue
            value = initial_value(name, p.shape, seed, **init_kwargs(self.cfg))
            p.copy_(value)


def bert_special_ids(vocab_size: int) -> tuple[int, int, int]:
    """bert's ``([PAD], [CLS], [MASK])``: the last three ids of the vocabulary, past the tokenizer's."""
    return vocab_size - 3, vocab_size - 2, vocab_size - 1


def mean_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The fp32 mean cross-entropy of ``logits [B, T, V]`` against ``targets [B, T]`` over the targets
    that are not -100: the default ``Transformer.loss_fn``."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)


def _canonical(name: str) -> str:
    return ".".join(part for part in name.split(".") if not part.startswith("_"))


def param_seed(seed: int, name: str) -> int:
    """The generator seed of parameter ``name`` under run seed ``seed``: zlib.crc32 of both (stable
    across processes and Python versions, unlike ``hash()``). 32 bits, because torch's CPU generator
    (mt19937) keeps only the low 32 bits of its seed; two parameters share a stream with
    probability 2^-32."""
    return zlib.crc32(f"{seed}:{name}".encode())


def init_kwargs(cfg) -> dict:
    """The keyword arguments of :func:`initial_value` for a model with fields ``cfg``."""
    return {"init_std": cfg.init_std, "n_layers": cfg.n_layers,
            "norm_gain": 0.0 if getattr(cfg, "norm_unit_offset", False) else 1.0}


def initial_value(
    name: str, shape: Sequence[int], seed: int, *, init_std: float = 0.02, n_layers: int = 1, norm_gain: float = 1.0
) -> torch.Tensor:
    """The initial value (fp32, CPU) of the parameter ``name`` of ``shape`` under the GPT-2 scheme
    (Radford et al. 2019 §2.3): zeros for biases, ``norm_gain`` (1; 0 for norms that scale by ``1 + weight``)
    for other 1-d tensors (norm gains), N(0, init_std) for matrices and embeddings, with std / sqrt(2 * n_layers)
    for the residual output projections. A layer that holds a shard of a parameter can take its slice of this."""
    parts = name.split(".")
    if parts[-1] == "bias":
        return torch.zeros(shape, device="cpu")
    if len(shape) == 1:
        return torch.full(shape, norm_gain, device="cpu")
    std = init_std / math.sqrt(2 * n_layers) if len(parts) >= 2 and parts[-2] in RESIDUAL_OUTPUTS else init_std
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape, device="cpu").normal_(0.0, std, generator=generator)
