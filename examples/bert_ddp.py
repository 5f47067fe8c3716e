"""A BERT-like encoder trained for classification with shardwise's data parallelism, from one's own script.

The classic setup: token + position embeddings, ``nn.TransformerEncoder`` (post-norm, GELU, as BERT,
Devlin et al. 2019 §3), a classifier on the first ([CLS]) position, padded sequences with a key padding
mask, trained data-parallel under torchrun. The data is synthetic and labelled: a sequence is positive
when it contains the marker token, which the model learns within a few epochs.

    torchrun --standalone --nproc-per-node 2 examples/bert_ddp.py --epochs 5
    torchrun --standalone --nproc-per-node 2 examples/bert_ddp.py --zero 2          # ZeRO-2 instead
    torchrun --standalone --nproc-per-node 2 examples/bert_ddp.py --algorithm ring  # our ring all-reduce

On two machines (four GPUs each), the same command on both, with the first machine's address:

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 \\
        --rdzv-id bert1 examples/bert_ddp.py --epochs 5 --ckpt-dir /shared/ckpt

Rank 0 prints the mean training loss of each epoch (over every rank); ``--ckpt-dir`` saves a checkpoint
after each epoch and a restarted job continues from the newest one (any world size, DDP or ZeRO).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise import api

PAD, CLS, MARK = 0, 1, 2


class Encoder(nn.Module):
    """Token + learned position embeddings, a post-norm GELU ``nn.TransformerEncoder`` and a [CLS] classifier."""

    def __init__(self, vocab: int = 64, d_model: int = 64, n_heads: int = 4, n_layers: int = 2, max_len: int = 32,
                 n_classes: int = 2, dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.pos = nn.Embedding(max_len, d_model)
        self.norm = nn.LayerNorm(d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, activation="gelu",
                                           batch_first=True, norm_first=False)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.classifier = nn.Linear(d_model, n_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.norm(self.tok(tokens) + self.pos(positions))
        x = self.encoder(x, src_key_padding_mask=tokens == PAD)
        return self.classifier(x[:, 0])


class MarkerDataset(torch.utils.data.Dataset):
    """``n`` sequences ``[CLS] w1 .. wk PAD ..`` of random lengths; label 1 when the marker token occurs."""

    def __init__(self, n: int = 512, seq_len: int = 32, vocab: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(MARK + 1, vocab, (n, seq_len), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (n,), generator=g)
        for i in range(n):
            self.tokens[i, lengths[i]:] = PAD
            if self.labels[i]:
                self.tokens[i, int(torch.randint(1, int(lengths[i]), (1,), generator=g))] = MARK
        self.tokens[:, 0] = CLS

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i], self.labels[i]


def train_epoch(model, optimizer, loader, device) -> float:
    """One pass over this rank's shard; the mean loss over every rank's batches."""
    model.train()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for tokens, labels in loader:
        tokens, labels = tokens.to(device), labels.to(device)
        loss = F.cross_entropy(model(tokens), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total += torch.tensor([loss.item(), 1.0], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total[0] / total[1])


def build(args, ctx: api.Context):
    """The wrapped model and its optimizer, as the command-line options ask."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank (DataParallel broadcasts rank 0's anyway)
    model = Encoder(dropout=args.dropout)
    make_opt = lambda m: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.01)  # noqa: E731
    if args.zero:
        return api.zero(model, make_opt, stage=args.zero, device=ctx.device)
    model = api.data_parallel(model.to(ctx.device), algorithm=args.algorithm)
    return model, make_opt(model)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (split over the ranks)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage (0: data parallel)")
    parser.add_argument("--algorithm", default="native", help="all-reduce algorithm without ZeRO (native, ring, ...)")
    parser.add_argument("--ckpt-dir", help="save after every epoch and resume from the newest checkpoint here")
    args = parser.parse_args(argv)

    ctx = api.init()
    model, optimizer = build(args, ctx)
    loader = api.data_loader(MarkerDataset(args.samples, seed=args.seed), args.batch_size, ctx, seed=args.seed)
    start = 0
    if args.ckpt_dir:
        found = api.load_checkpoint(args.ckpt_dir, model, optimizer)
        if found is not None:
            start = found[1]["epoch"] + 1
            if ctx.is_main:
                print(f"resumed after epoch {start}")
    losses = []
    for epoch in range(start, args.epochs):
        loader.sampler.set_epoch(epoch)
        loss = train_epoch(model, optimizer, loader, ctx.device)
        losses.append(loss)
        if ctx.is_main:
            print(f"epoch {epoch + 1}: loss {loss:.4f}" + ("" if math.isfinite(loss) else " (diverged)"), flush=True)
        if args.ckpt_dir:
            api.save_checkpoint(args.ckpt_dir, epoch + 1, model, optimizer, extra={"epoch": epoch})
    return losses


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
