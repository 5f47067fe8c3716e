"""A checkpoint holds the fp32 master weights, whatever ``parallel.zero_param_dtype`` keeps in the flat buffers.

With ``parallel.zero_param_dtype bf16`` ZeRO trains bf16 flat parameters beside fp32 masters (Rajbhandari et al.
2020 §3.1; Micikevicius et al. 2018): the masters are the model, the bf16 copy is their rounding. A checkpoint
of the working copy would resume a different model. Here, for ZeRO 1, 2 and 3 with bf16 precision, outside a
pipeline (dp 2) and inside one (pp 2 x dp 2): a run with checkpoints at steps 1 and 2; its directory copied
without step 2 and resumed from step 1 must end bit-identical (atol 0) to the uninterrupted run -- losses,
pre-clip gradient norms and final weights -- and the checkpoint of step 2 must hold the final masters themselves
(fp32, equal bit for bit; bf16 could not hold them).

All runs of a world size go through one harness call (worker start-up dominates on 2 cores).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from shardwise.train.checkpoint import list_checkpoints
from shardwise.train.state import open_checkpoint
from tests.harness import run_on_ranks
from tests.test_pipeline_zero import _train_many
from tests.test_train import make_config

BASE = {"train.precision": "bf16", "parallel.zero_param_dtype": "bf16", "train.steps": 2, "ckpt.every": 1,
        "ckpt.keep": 5, "train.global_batch": 4, "data.seq_len": 16}
LAYOUTS = {
    2: {f"zero{z}": {"parallel.zero": z} for z in (1, 2, 3)},
    4: {f"zero{z}-pp2": {"parallel.zero": z, "parallel.pp": 2, "parallel.dp": 2, "parallel.microbatches": 2}
        for z in (1, 2, 3)},
}


def _resumed_copy(src: Path, dst: Path) -> None:
    """``src``'s run directory as it was after step 1: step 2's checkpoint removed."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step_00000002")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    tmp = tmp_path_factory.mktemp("masters")
    out = {}
    for world, layouts in LAYOUTS.items():
        jobs = [(make_config(tmp / name, cache_dir, world, **BASE, **o), str(tmp / name), None)
                for name, o in layouts.items()]
        full = run_on_ranks(world, _train_many, jobs)[0]
        for name in layouts:
            _resumed_copy(tmp / name, tmp / f"{name}-resumed")
        jobs = [(make_config(tmp / f"{name}-resumed", cache_dir, world, **BASE, **o, **{"ckpt.resume": True}),
                 str(tmp / f"{name}-resumed"), None) for name, o in layouts.items()]
        resumed = run_on_ranks(world, _train_many, jobs)[0]
        out.update({name: (f, r) for name, f, r in zip(layouts, full, resumed, strict=True)})
    return out, tmp


NAMES = [name for layouts in LAYOUTS.values() for name in layouts]


@pytest.mark.parametrize("name", NAMES)
def test_resume_of_bf16_parameters_is_bit_identical(runs, name):
    (full, resumed), _ = runs[0][name], runs[1]
    assert len(resumed[0]) == 1, "resumed from step 1"
    assert resumed[0] == full[0][1:], "losses"
    assert resumed[2] == full[2][1:], "pre-clip gradient norms"
    assert full[1].keys() == resumed[1].keys()
    for key, value in full[1].items():
        assert torch.equal(value, resumed[1][key]), key


@pytest.mark.parametrize("name", NAMES)
def test_the_checkpoint_holds_the_fp32_masters(runs, name):
    """The final weights (the masters, gathered) are fp32 values bf16 cannot hold, and step 2's checkpoint
    holds exactly them."""
    (full, _), tmp = runs[0][name], runs[1]
    masters = full[1]
    saved = open_checkpoint(list_checkpoints(tmp / name / "checkpoints")[-1]).model_state()
    assert set(saved) == set(masters)
    for key, value in masters.items():
        assert value.dtype == torch.float32, key
        assert saved[key].dtype == torch.float32, key
        assert torch.equal(saved[key], value), key
    weights = [v for k, v in masters.items() if k.endswith(".weight") and v.dim() == 2]
    assert any(not torch.equal(w, w.bfloat16().float()) for w in weights), "the masters are more than bf16"


def test_export_writes_the_asked_dtype_from_the_masters(runs, tmp_path):
    """``shardwise export --dtype fp32`` of a bf16-parameter run writes the masters; the default (the run's
    precision, bf16) writes their rounding -- the same as rounding the masters, not a second rounding."""
    from safetensors.torch import load_file

    from shardwise.hf.export import export_run

    (full, _), run_dir = runs[0]["zero2"], runs[1] / "zero2"
    masters = full[1]["tok_emb.weight"]
    for dtype, expected in (("fp32", masters), (None, masters.bfloat16())):
        out = export_run(run_dir, tmp_path / f"export-{dtype}", dtype=dtype)
        written = load_file(str(out / "model.safetensors"))["transformer.wte.weight"]
        assert written.dtype == expected.dtype and torch.equal(written, expected), dtype
