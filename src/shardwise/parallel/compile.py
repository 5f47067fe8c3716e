"""``torch.compile`` applied from outside the model, one transformer block at a time.

Each block's ``forward`` is replaced on the instance by its compiled form (TorchDynamo captures the
graph, TorchInductor fuses its element-wise work into the matmuls' neighbours: Ansel et al. 2024,
"PyTorch 2: Faster Machine Learning Through Dynamic Python Bytecode Transformation and Graph
Compilation", ASPLOS '24, §3-4). Per block, after tensor parallelism and recomputation, as
torchtitan's ``parallelize`` compiles each block after activation checkpointing: every block has the
same code, so one compilation serves them all, and module hooks (ZeRO-3's gathers, the
data-parallel gradient hooks) stay outside the compiled region. Parameter names and state dicts are
unchanged. Compilation is lazy: it happens on the first forward.
"""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(module: nn.Module) -> list[int]:
    """Compile the ``forward`` of every transformer block in ``module``; returns their layer ids."""
    from shardwise.model.transformer import Block

    touched = []
    for block in (m for m in module.modules() if isinstance(m, Block)):
        block.forward = torch.compile(block.forward)
        touched.append(block.layer_id)
    return touched
