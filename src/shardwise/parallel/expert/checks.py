"""The config rules of mixture-of-experts blocks and expert parallelism, functions of the config alone
(no torch): the MoE fields in range, ``ep`` against the experts and the dp x cp ranks, and what
experts do not compose with yet, one line each."""

from __future__ import annotations

from shardwise.checks import Unused, choice, divisors, positive
from shardwise.config import Config, ConfigError, ModelConfig

MOE_FIELDS = ("moe_top_k", "moe_every", "moe_shared", "moe_capacity_factor", "moe_aux_coeff", "moe_z_coeff",
              "moe_router", "moe_d_ff", "moe_dense_first", "moe_groups", "moe_gate_scale")


def check_moe_fields(m: ModelConfig) -> None:
    """The mixture-of-experts fields (:mod:`shardwise.model.moe`): sizes and coefficients in range."""
    positive("model.n_experts", m.n_experts, allow_zero=True)
    if m.n_experts and not 1 <= m.moe_top_k <= m.n_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must be in 1..model.n_experts={m.n_experts}")
    positive("model.moe_every", m.moe_every)
    if m.n_experts and m.moe_every > m.n_layers:
        raise ConfigError(f"model.moe_every={m.moe_every} exceeds model.n_layers={m.n_layers}: no block would be "
                          f"MoE; use 1..{m.n_layers}")
    for key in ("moe_shared", "moe_capacity_factor", "moe_aux_coeff", "moe_z_coeff", "moe_bias_rate"):
        positive(f"model.{key}", getattr(m, key), allow_zero=True)
    choice("model.moe_router", m.moe_router)
    positive("model.moe_d_ff", m.moe_d_ff)
    positive("model.moe_dense_first", m.moe_dense_first, allow_zero=True)
    positive("model.moe_gate_scale", m.moe_gate_scale)
    positive("model.moe_groups", m.moe_groups)
    if not m.n_experts:
        return
    if m.moe_dense_first >= m.n_layers:
        raise ConfigError(f"model.moe_dense_first={m.moe_dense_first} leaves no MoE block among model.n_layers="
                          f"{m.n_layers}; use 0..{m.n_layers - 1}")
    if m.n_experts % m.moe_groups:
        raise ConfigError(f"model.moe_groups={m.moe_groups} does not divide model.n_experts={m.n_experts}; use one "
                          f"of {divisors(m.n_experts)}")
    if not 1 <= m.moe_group_top_k <= m.moe_groups:
        raise ConfigError(f"model.moe_group_top_k={m.moe_group_top_k} must be in 1..model.moe_groups={m.moe_groups}")
    if m.moe_groups > 1 and m.moe_top_k > m.moe_group_top_k * (m.n_experts // m.moe_groups):
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} exceeds the experts of model.moe_group_top_k="
                          f"{m.moe_group_top_k} groups ({m.moe_group_top_k * (m.n_experts // m.moe_groups)})")
    if m.mlp_activation != "silu":
        raise ConfigError(f"model.mlp_activation={m.mlp_activation!r} with model.n_experts={m.n_experts}: our "
                          "experts are SwiGLU; use 'silu' or a dense model")


def expert_parallel_error(dp: int, cp: int, ep: int, n_experts: int) -> str | None:
    """Why ``ep`` cannot split ``n_experts`` experts in a layout of ``dp`` x ``cp`` ranks holding the same weights
    (``None``: it can) -- the one rule the trainer's checks, the planner's search and the simulator apply.

    The ep groups are runs of ``ep`` of the dp x cp ranks (:class:`~shardwise.dist.mesh.ParallelDims`;
    torchtitan's "dp2ep" carves them out of dp x cp the same way), so ep divides dp * cp -- it may span data-
    and context-parallel ranks -- and the experts, which it splits evenly."""
    if ep > 1 and not n_experts:
        return (f"parallel.ep={ep} needs a mixture-of-experts model; set model.n_experts (a multiple of "
                "parallel.ep) or parallel.ep=1")
    if n_experts % ep:
        return f"parallel.ep={ep} does not divide model.n_experts={n_experts}; use one of {divisors(n_experts)}"
    if (dp * cp) % ep:
        return f"parallel.ep={ep} does not divide parallel.dp*cp={dp * cp}; use one of {divisors(dp * cp)}"
    return None


def check(cfg: Config) -> None:
    """Expert parallelism (:mod:`.dispatch`) splits model.n_experts over runs of parallel.ep of the dp x cp
    ranks (:func:`expert_parallel_error`)."""
    p, m = cfg.parallel, cfg.model
    why = expert_parallel_error(p.dp, p.cp, p.ep, m.n_experts or 0)
    if why:
        raise ConfigError(why)
    if p.etp != 1:
        check_expert_tensor_parallel(cfg)
    choice("parallel.ep_dispatch", p.ep_dispatch)
    if p.ep > 1 and p.ep_dispatch == "padded":
        if not m.moe_capacity_factor:
            raise ConfigError("parallel.ep_dispatch='padded' sends every expert its capacity of rows: it needs "
                              "model.moe_capacity_factor > 0; set one or use parallel.ep_dispatch='exchange'")
        if p.etp > 1:
            raise ConfigError(f"parallel.ep_dispatch='padded' with parallel.etp={p.etp}: experts split over tp are "
                              "fed by the exchanging dispatch only; use parallel.ep_dispatch='exchange'")
    if p.ep > 1 and cfg.comm.algorithm != "native" and cfg.run.device == "cuda" and p.backend == "gloo":
        raise ConfigError(f"parallel.ep={p.ep} with run.device='cuda' and parallel.backend='gloo': our pairwise "
                          f"all-to-all (comm.algorithm={cfg.comm.algorithm!r}) sends tokens point to point, and "
                          "gloo's point-to-point takes CPU tensors only; use parallel.backend='nccl' (or 'auto') "
                          "or run.device='cpu'")
    if m.n_experts and m.moe_capacity_factor and (p.sequence_parallel or p.cp > 1):
        raise ConfigError(f"model.moe_capacity_factor={m.moe_capacity_factor} with "
                          f"{'parallel.sequence_parallel=true' if p.sequence_parallel else f'parallel.cp={p.cp}'}: a "
                          "capacity ranks each expert's slots over the whole sequence, which is spread over ranks; "
                          "use model.moe_capacity_factor=0 (dropless)")
    if m.n_experts and cfg.ps.servers and m.moe_router == "sigmoid_bias" and cfg.ps.consistency != "bsp":
        raise ConfigError(f"ps.consistency={cfg.ps.consistency!r} with model.moe_router='sigmoid_bias': each worker "
                          "moves its router's balancing bias (a buffer the servers do not hold) by the load of the "
                          "step, which the workers agree on only in lock-step; use ps.consistency='bsp'")


def check_expert_tensor_parallel(cfg: Config) -> None:
    """``parallel.etp`` (:mod:`.tensor`): each expert's hidden units over the tensor-parallel ranks."""
    p, m = cfg.parallel, cfg.model
    if not m.n_experts:
        raise ConfigError(f"parallel.etp={p.etp} splits experts over tensor-parallel ranks: it needs a "
                          "mixture-of-experts model; set model.n_experts or parallel.etp=1")
    if p.etp != p.tp:
        raise ConfigError(f"parallel.etp={p.etp} with parallel.tp={p.tp}: experts split over the tensor-parallel "
                          f"ranks only (etp = tp; Megatron's parallel folding with other sizes is not built); use "
                          f"parallel.etp=1 or {p.tp}")
    width = m.moe_d_ff or m.d_ff
    if width % p.etp:
        raise ConfigError(f"parallel.etp={p.etp} does not divide the experts' width {width} (model.moe_d_ff, or "
                          f"model.d_ff when it is unset); use one of {divisors(width)}")


def unused(cfg: Config) -> list[Unused]:
    m = cfg.model
    why = "configures mixture-of-experts blocks, but model.n_experts=0; set model.n_experts or remove it"
    bias = (f"moves the sigmoid_bias router's balancing bias, but model.moe_router={m.moe_router!r} has none; "
            "set model.moe_router='sigmoid_bias' or remove it")
    dispatch = "chooses how tokens reach experts split over ranks, but parallel.ep=1; set parallel.ep or remove it"
    return [Unused(f"model.{k}", m.n_experts > 0, why) for k in MOE_FIELDS] + [
        Unused("parallel.ep_dispatch", cfg.parallel.ep > 1, dispatch),
        Unused("model.moe_bias_rate", m.n_experts > 0 and m.moe_router == "sigmoid_bias", bias),
        Unused("model.moe_group_top_k", m.n_experts > 0 and m.moe_groups > 1, "picks among expert groups, but "
               f"model.moe_groups={m.moe_groups}; set model.moe_groups > 1 or remove it")]
