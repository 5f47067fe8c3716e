"""Our DataParallel: equal to torch DDP, equal to one process, buckets, accumulation, unused parameters, overlap."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardwise.dist import ParallelDims
from shardwise.parallel import DataParallel
from tests.harness import run_on_ranks

TINY_BUCKET_MB = 2e-3  # ~2 KiB: every parameter or two gets a bucket of its own


# ---- small models -------------------------------------------------------------------------------


class MLP(nn.Module):
    """Three linear layers; ``fc2`` can be skipped per call and ``spare`` is never used."""

    def __init__(self, d_in: int = 8, hidden: int = 32, d_out: int = 4, spare: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, d_out)
        self.spare = nn.Linear(hidden, hidden) if spare else None

    def forward(self, x, skip_fc2: bool = False):
        h = F.gelu(self.fc1(x))
        if not skip_fc2:
            h = F.gelu(self.fc2(h))
        return self.fc3(h)


class TinyLM(nn.Module):
    """Embedding, position table, residual MLP layers with causal mixing, tied head; a bool buffer."""

    def __init__(self, vocab: int = 37, d: int = 16, n_layers: int = 3, seq: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("causal", torch.ones(seq, seq, dtype=torch.bool).tril())

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:t]
        mix = self.causal[:t, :t].float()
        mix = mix / mix.sum(-1, keepdim=True)
        for layer in self.layers:
            x = x + layer(mix @ x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _transformer():
    from shardwise.config import Config
    from shardwise.config_resolve import resolve
    from shardwise.model import Transformer

    cfg = resolve(Config.load(overrides={"model.preset": "tiny"}), world_size=1, tokenizer_vocab=257).model
    return Transformer(cfg)


def build(kind: str, seed: int = 0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return MLP(**kw)
    if kind == "tinylm":
        return TinyLM(**kw)
    model = _transformer()
    model.reset_parameters(seed)
    return model


def global_batch(kind: str, step: int, size: int):
    """The same global batch on every rank (and in the single-process reference)."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "mlp":
        return torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)
    vocab, seq = (37, 8) if kind == "tinylm" else (257, 16)
    tokens = torch.randint(0, vocab, (size, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(net, kind: str, x, y, **kw):
    if kind == "mlp":
        return F.mse_loss(net(x, **kw), y)
    return net(x, y)


def shard(batch, rank: int, world: int):
    return tuple(t.chunk(world)[rank] for t in batch)


def _rank_world():
    return dist.get_rank(), dist.get_world_size()


# ---- our gradients == torch DDP's ----------------------------------------------------------------


def _compare_with_torch_ddp(kind: str, bucket_mb: float, unused: str = "none", steps: int = 3,
                            set_to_none: bool = True, last_bucket_mb: float | None = None):
    """Run ours and torch DDP side by side on identical replicas and data; return the largest grad difference.

    unused: "none"; "all" (MLP.spare never used); "rank1" (fc2 skipped on rank 1 only).
    set_to_none=False keeps .grad tensors between steps (ours then accumulates into its bucket views).
    """
    rank, world = _rank_world()
    spare = {"spare": True} if unused == "all" else {}
    ours_model = build(kind, **spare)
    ref_model = copy.deepcopy(ours_model)
    ours = DataParallel(ours_model, bucket_mb=bucket_mb, last_bucket_mb=last_bucket_mb)
    ref = DDP(ref_model, bucket_cap_mb=bucket_mb, find_unused_parameters=unused != "none")
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours_model, ref_model)]
    worst, none_pattern = 0.0, []
    for step in range(steps):
        x, y = shard(global_batch(kind, step, 8), rank, world)
        kw = {"skip_fc2": rank == 1} if unused == "rank1" else {}
        for net, opt in zip((ours, ref), opts, strict=True):
            opt.zero_grad(set_to_none=set_to_none)
            loss_of(net, kind, x, y, **kw).backward()
        for (name, a), b in zip(ours_model.named_parameters(), ref_model.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None), f"{name}: ours {a.grad is None}, DDP {b.grad is None}"
            if a.grad is None:
                none_pattern.append(name)
                continue
            worst = max(worst, (a.grad - b.grad).abs().max().item())
        for opt in opts:
            opt.step()
    return worst, sorted(set(none_pattern)), len(ours.bucket_sizes)


TINYLM_SMALL_BUCKETS = 8
"""TinyLM's buckets under TINY_BUCKET_MB, counted by hand: the cap is int(2e-3 * 2**20) = 2097 bytes.
Registration order is TinyLM's own parameter first (pos), then embed, layers 0-2, norm (the tied
head is the embedding). Reversed, in fp32 bytes: norm.bias 64, norm.weight 64, then per layer, last
first, fc-out bias 64, weight 4096, fc-in bias 256, weight 4096, ln bias 64, weight 64; then embed
2368, pos 512. A bucket closes once it holds >= 2097 B:
[norm.b, norm.w, L2.b2, L2.w2] 4288 | [L2.b1, L2.w1] 4352 | [L2.ln.b, L2.ln.w, L1.b2, L1.w2] 4288 |
[L1.b1, L1.w1] | [L1.ln.b, L1.ln.w, L0.b2, L0.w2] | [L0.b1, L0.w1] | [L0.ln.b, L0.ln.w, embed] 2496 |
[pos] 512 -- eight buckets."""


def test_tinylm_bucket_count_by_hand():
    """The hand count above, from parameter sizes only (independent of the bucketing code)."""
    model = build("tinylm")
    sizes = [(name, p.numel() * p.element_size()) for name, p in model.named_parameters()]
    layer = [("0.weight", 64), ("0.bias", 64), ("1.weight", 4096), ("1.bias", 256), ("3.weight", 4096), ("3.bias", 64)]
    assert sizes == [("pos", 512), ("embed.weight", 2368),
                     *[(f"layers.{i}.{k}", v) for i in range(3) for k, v in layer],
                     ("norm.weight", 64), ("norm.bias", 64)]
    assert int(TINY_BUCKET_MB * 2**20) == 2097


def test_the_last_bucket_holds_only_the_gradients_that_come_last():
    """TinyLM with a 5000-byte cap and a 3000-byte last bucket, by hand: reversed (the order backward produces
    gradients), the sizes are 64, 64 (norm), then per layer 64, 4096, 256, 4096, 64, 64 (fc2.b, fc2.w, fc1.b,
    fc1.w, ln.b, ln.w), then embed 2368, pos 512. Cut from the end, each bucket stops before the parameter that
    would pass its limit: 3000 B for the last one -- pos 512 + embed 2368 + L0.ln.w 64 = 2944 (L0.ln.b would
    make 3008) -- then 6000 capped at 5000 for every one before it: [L0.fc1.b, L0.fc1.w, L0.ln.b] 4416,
    [L1.ln, L0.fc2] 4288, [L1.fc1] 4352, [L2.ln, L1.fc2] 4288, [L2.fc1] 4352, and what is left, [norm,
    L2.fc2] 4288, first -- seven in all. A cap no larger than the last bucket's keeps torch DDP's cut (the
    eight buckets above)."""
    from shardwise.parallel.data import _assign_buckets

    model = build("tinylm")
    names = {id(p): n for n, p in model.named_parameters()}
    buckets = _assign_buckets(list(model.parameters()), 5000, last_bytes=3000)
    assert [names[id(p)] for p in buckets[-1]] == ["layers.0.0.weight", "embed.weight", "pos"]
    assert [names[id(p)] for p in buckets[-2]] == ["layers.0.1.bias", "layers.0.1.weight", "layers.0.0.bias"]
    assert [names[id(p)] for p in buckets[0]] == ["norm.bias", "norm.weight", "layers.2.3.bias", "layers.2.3.weight"]
    assert [sum(p.numel() * p.element_size() for p in b) for b in buckets] == [4288, 4352, 4288, 4352, 4288,
                                                                               4416, 2944]
    assert sum(len(b) for b in buckets) == len(names)
    assert len(_assign_buckets(list(model.parameters()), 2097, last_bytes=1 << 20)) == TINYLM_SMALL_BUCKETS
    assert len(_assign_buckets(list(model.parameters()), 2097)) == TINYLM_SMALL_BUCKETS  # the default


@pytest.mark.parametrize(
    "kind, bucket_mb, set_to_none, expected_buckets, last_bucket_mb",
    [("mlp", 25.0, True, 1, None), ("tinylm", 25.0, True, 1, None),
     ("tinylm", TINY_BUCKET_MB, True, TINYLM_SMALL_BUCKETS, None),
     ("tinylm", TINY_BUCKET_MB, False, TINYLM_SMALL_BUCKETS, None),
     ("tinylm", 5000 / 2**20, True, 7, 3000 / 2**20)],  # the cut counted by hand above
)
def test_gradients_equal_torch_ddp(kind, bucket_mb, set_to_none, expected_buckets, last_bucket_mb):
    results = run_on_ranks(2, _compare_with_torch_ddp, kind, bucket_mb, set_to_none=set_to_none,
                           last_bucket_mb=last_bucket_mb)
    for worst, nones, n_buckets in results:
        assert worst == 0.0  # same arithmetic: divide by 2 (exact) and a two-term sum
        assert nones == []
        assert n_buckets == expected_buckets


@pytest.mark.parametrize("unused", ["all", "rank1"])
def test_unused_parameters_match_torch_ddp(unused):
    """No hang; unused everywhere -> .grad stays None (as in DDP); unused on one rank -> the average."""
    for worst, nones, _ in run_on_ranks(2, _compare_with_torch_ddp, "mlp", TINY_BUCKET_MB, unused):
        assert worst == 0.0
        assert nones == (["spare.bias", "spare.weight"] if unused == "all" else [])


# ---- data parallel == one process --------------------------------------------------------------


def train(kind: str, opt_name: str, steps: int, batch: int, bucket_mb: float = 25.0, accum: int = 1,
          distributed: bool = True, set_to_none: bool = True):
    """``steps`` optimizer steps on a fixed global batch sequence; returns (per-step mean losses, final weights)."""
    rank, world = _rank_world() if distributed else (0, 1)
    model = build(kind)
    net = DataParallel(model, bucket_mb=bucket_mb) if distributed else model
    if opt_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, eps=1e-6)  # see test_train.py
    losses = []
    for step in range(steps):
        x, y = shard(global_batch(kind, step, batch), rank, world)
        opt.zero_grad(set_to_none=set_to_none)
        total = torch.zeros(())
        for i, (mx, my) in enumerate(zip(x.chunk(accum), y.chunk(accum), strict=True)):
            quiet = distributed and i < accum - 1
            with net.no_sync() if quiet else contextlib.nullcontext():
                loss = loss_of(net, kind, mx, my) / accum
                loss.backward()
            total += loss.detach()
        if distributed:
            dist.all_reduce(total)
            total /= world
        losses.append(total.item())
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_training(results, reference, atol):
    ref_losses, ref_weights = reference
    for rank, (losses, weights) in enumerate(results):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=atol, rtol=0,
                                   msg=lambda m, r=rank: f"rank {r} losses: {m}")
        for name, w in weights.items():
            torch.testing.assert_close(w, ref_weights[name], atol=atol, rtol=0,
                                       msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}")
        for name, w in weights.items():  # replicas stay bit-identical
            assert torch.equal(w, results[0][1][name]), name


@pytest.mark.parametrize(
    "world, kind, opt_name",
    [(2, "mlp", "sgd"), (2, "tinylm", "adamw"), (4, "mlp", "adamw"), (4, "tinylm", "sgd")],
)
def test_trains_like_one_process(world, kind, opt_name):
    results = run_on_ranks(world, train, kind, opt_name, 10, 8)
    _assert_same_training(results, train(kind, opt_name, 10, 8, distributed=False), atol=1e-5)


def test_transformer_trains_like_one_process():
    results = run_on_ranks(2, train, "transformer", "adamw", 4, 4, TINY_BUCKET_MB * 50)
    _assert_same_training(results, train("transformer", "adamw", 4, 4, distributed=False), atol=1e-5)


def test_many_small_buckets_equal_one_big_bucket():
    small = run_on_ranks(2, train, "tinylm", "adamw", 5, 8, TINY_BUCKET_MB)
    big = run_on_ranks(2, train, "tinylm", "adamw", 5, 8, 25.0)
    for (ls, ws), (lb, wb) in zip(small, big, strict=True):
        assert ls == lb
        assert all(torch.equal(ws[k], wb[k]) for k in ws)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_accumulation_trains_like_one_process(set_to_none):
    results = run_on_ranks(2, train, "tinylm", "adamw", 4, 12, TINY_BUCKET_MB, 3, set_to_none=set_to_none)
    _assert_same_training(results, train("tinylm", "adamw", 4, 12, distributed=False), atol=1e-5)


def _accumulation_vs_concatenated(k: int):
    """k micro-batches (no_sync for the first k-1) vs one backward on their concatenation."""
    rank, world = _rank_world()
    calls = []

    def counting_all_reduce(t, group):
        calls.append(t.numel())
        return dist.all_reduce(t, group=group, async_op=True)

    a, b = build("tinylm"), build("tinylm")
    dp_a = DataParallel(a, bucket_mb=TINY_BUCKET_MB, all_reduce_fn=counting_all_reduce)
    dp_b = DataParallel(b, bucket_mb=TINY_BUCKET_MB)
    x, y = shard(global_batch("tinylm", 0, 4 * k), rank, world)
    calls_in_no_sync = 0
    for i, (mx, my) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
        with dp_a.no_sync() if i < k - 1 else contextlib.nullcontext():
            (loss_of(dp_a, "tinylm", mx, my) / k).backward()
        if i == k - 2:
            calls_in_no_sync = len(calls)
    loss_of(dp_b, "tinylm", x, y).backward()
    worst = max((pa.grad - pb.grad).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(), strict=True))
    return worst, calls_in_no_sync, len(calls), len(dp_a.bucket_sizes)


def test_no_sync_accumulation_equals_concatenated_batch():
    for worst, quiet_calls, total_calls, n_buckets in run_on_ranks(2, _accumulation_vs_concatenated, 3):
        assert worst < 1e-6
        assert quiet_calls == 0  # nothing communicated inside no_sync
        assert total_calls == n_buckets == TINYLM_SMALL_BUCKETS


# ---- broadcast, groups, one rank -----------------------------------------------------------------


def _broadcast_initial_weights(src: int):
    rank, _ = _rank_world()
    model = build("tinylm", seed=100 + rank)  # every rank starts different
    model.causal.fill_(rank == src)  # a bool buffer that differs too
    before = {k: v.clone() for k, v in model.state_dict().items()}
    DataParallel(model, broadcast_from=src)
    return before, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("src", [0, 1])
def test_initial_weights_are_broadcast(src):
    results = run_on_ranks(2, _broadcast_initial_weights, src)
    source_before = results[src][0]
    assert not torch.equal(results[0][0]["embed.weight"], results[1][0]["embed.weight"])
    for _, after in results:
        assert all(torch.equal(after[k], source_before[k]) for k in after)


def _data_parallel_over_mesh_dp_group():
    """4 ranks as dp=2 x tp=2: DataParallel over mesh.dp_group averages over dp peers only."""
    mesh = ParallelDims(dp=2, tp=2).build("cpu")
    model = build("mlp", seed=7 + mesh.global_rank)
    dp = DataParallel(model, group=mesh.dp_group, broadcast_from=1)
    x, y = shard(global_batch("mlp", 0, 8), mesh.dp_rank, 2)
    loss_of(dp, "mlp", x, y).backward()
    ref = build("mlp", seed=7 + mesh.ranks("dp")[1])  # weights of the dp group's rank 1
    local = []
    for r in range(2):
        ref.zero_grad()
        loss_of(ref, "mlp", *shard(global_batch("mlp", 0, 8), r, 2)).backward()
        local.append([p.grad.clone() for p in ref.parameters()])
    expected = [(g0 + g1) / 2 for g0, g1 in zip(*local, strict=True)]
    return max((p.grad - e).abs().max().item() for p, e in zip(model.parameters(), expected, strict=True))


def test_data_parallel_over_a_mesh_subgroup():
    assert max(run_on_ranks(4, _data_parallel_over_mesh_dp_group)) < 1e-6


def _one_rank_is_plain_training():
    a, b = build("tinylm"), build("tinylm")
    dp = DataParallel(a)
    x, y = global_batch("tinylm", 0, 4)
    loss_of(dp, "tinylm", x, y).backward()
    loss_of(b, "tinylm", x, y).backward()
    same = all(torch.equal(pa.grad, pb.grad) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))
    return same, dp.comm_bytes_last_step, dp.bucket_sizes


def test_one_rank_group_is_a_no_op():
    assert run_on_ranks(1, _one_rank_is_plain_training) == [(True, 0, [])]


# ---- overlap ------------------------------------------------------------------------------------


def _launch_and_hook_order():
    """Record when each gradient becomes ready and when each bucket's all-reduce is launched."""
    events = []

    def recording_all_reduce(t, group):
        events.append(("launch", t.numel()))
        return dist.all_reduce(t, group=group, async_op=True)

    model = build("tinylm")
    dp = DataParallel(model, bucket_mb=TINY_BUCKET_MB, all_reduce_fn=recording_all_reduce, comm_thread=False)
    for name, p in model.named_parameters():  # registered after ours, so they run right after it
        p.register_post_accumulate_grad_hook(lambda p, n=name: events.append(("grad", n)))
    x, y = global_batch("tinylm", dist.get_rank(), 4)
    loss_of(dp, "tinylm", x, y).backward()
    n_params = sum(1 for _ in model.parameters())
    return events, dp.bucket_sizes, n_params, dp.overlapped_buckets_last_step, dp.comm_bytes_last_step


def test_all_reduce_overlaps_backward():
    for events, sizes, n_params, overlapped, comm_bytes in run_on_ranks(2, _launch_and_hook_order):
        kinds = [k for k, _ in events]
        assert kinds.count("grad") == n_params and kinds.count("launch") == len(sizes) == TINYLM_SMALL_BUCKETS
        first_launch, last_grad = kinds.index("launch"), len(kinds) - 1 - kinds[::-1].index("grad")
        assert first_launch < last_grad, "no bucket was launched before backward produced its last gradient"
        assert overlapped >= 1
        # buckets go out in bucket order (the same on every rank); each carries one flag per parameter
        launched = [n for k, n in events if k == "launch"]
        assert len(launched) == len(sizes) and all(n > s for n, s in zip(launched, sizes, strict=True))
        assert comm_bytes == 4 * sum(launched)


# ---- the communication thread (blocking algorithms overlap backward too) -------------------------


def _comm_thread_overlap():
    """A *blocking* all-reduce fn whose first call waits until backward has produced every gradient.

    Run inline it would block backward and wait out its timeout; on the communication thread
    backward goes on meanwhile. Then: gradients equal native DataParallel's bit for bit, and
    no thread is left behind.
    """
    import threading

    model = build("tinylm")
    ref_model = copy.deepcopy(model)
    n_params = sum(1 for _ in model.parameters())
    all_grads, seen, calls = threading.Event(), [], []

    def blocking_all_reduce(t, group):
        if not calls:
            calls.append(all_grads.wait(timeout=30))
        calls.append(threading.current_thread() is threading.main_thread())
        dist.all_reduce(t, group=group)  # synchronous, like our point-to-point algorithms

    dp = DataParallel(model, bucket_mb=TINY_BUCKET_MB, all_reduce_fn=blocking_all_reduce)
    ref = DataParallel(ref_model, bucket_mb=TINY_BUCKET_MB)

    def count(p):
        seen.append(p)
        if len(seen) == n_params:
            all_grads.set()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(count)
    for step in range(2):
        x, y = shard(global_batch("tinylm", step, 8), *_rank_world())
        for net in (dp, ref):
            net.zero_grad(set_to_none=True)
            loss_of(net, "tinylm", x, y).backward()
    equal = all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref_model.parameters(), strict=True))
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("DataParallel comm")]
    return calls[0], any(calls[1:]), equal, len(dp.bucket_sizes), leftover


def test_blocking_all_reduce_overlaps_backward_on_the_comm_thread():
    for overlapped, on_main, equal, n_buckets, leftover in run_on_ranks(2, _comm_thread_overlap):
        assert overlapped, "backward did not go on while the first bucket was being reduced"
        assert not on_main and equal and n_buckets == TINYLM_SMALL_BUCKETS
        assert leftover == [], leftover


def _comm_thread_failure():
    """A failure in the communication thread is raised from backward(), naming the bucket; the
    buckets after it are not run; the wrapper trains normally afterwards."""
    import threading

    model = build("tinylm")
    ref_model = copy.deepcopy(model)
    calls = []

    def failing_all_reduce(t, group):
        calls.append(len(calls))
        if fail and len(calls) == 2:
            raise ValueError("all_reduce/ring: injected failure")
        dist.all_reduce(t, group=group)

    dp = DataParallel(model, bucket_mb=TINY_BUCKET_MB, all_reduce_fn=failing_all_reduce)
    ref = DataParallel(ref_model, bucket_mb=TINY_BUCKET_MB)
    x, y = shard(global_batch("tinylm", 0, 8), *_rank_world())
    fail = True
    try:
        loss_of(dp, "tinylm", x, y).backward()
        message = "no error"
    except RuntimeError as e:
        message = str(e)
    calls_when_failed = len(calls)
    fail = False
    for net in (dp, ref):
        net.zero_grad(set_to_none=True)
        loss_of(net, "tinylm", x, y).backward()
    equal = all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref_model.parameters(), strict=True))
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("DataParallel comm")]
    return message, calls_when_failed, equal, leftover


def test_comm_thread_failure_surfaces_in_backward():
    for message, calls_when_failed, equal, leftover in run_on_ranks(2, _comm_thread_failure):
        assert "bucket 1" in message and "all_reduce/ring: injected failure" in message, message
        assert calls_when_failed == 2, "buckets after the failed one must not be run"
        assert equal and leftover == []
