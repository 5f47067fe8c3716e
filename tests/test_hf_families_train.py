"""A run started from a transformers directory of each new family trains the same model under the layouts that
touch what the family adds: its first loss is transformers' loss on the same batch (fp32, 1e-5), and where the
family has a module a layout splits or wraps (latent attention and the grouped router under tp, ep and cp; OLMo
2's whole-projection QK-norm under tp; Gemma's sandwich norms and soft-caps under tp with sequence parallelism and
selective recompute; a sliding window with dropout under cp), the layout trains exactly what one process trains
(losses, pre-clip gradient norms, weights). After training, the export is the trained function in transformers.

Which layout proves what, so that no layout is repeated for a feature another family already proves under it:

* tp 2: Qwen3 (head_dim != d / h splits the heads by their own width), OLMo 2 (the norm over the whole split
  projection), Gemma 2 (+ sequence parallelism and selective recompute: post-norms on the rank's tokens, soft-capped
  logits split over the vocabulary), DeepSeek-V3 (heads of the latent up-projections; the down-projections and their
  norms whole, their gradients summed);
* cp 2: Mistral (allgather, a window with dropout), Gemma 3 (Ulysses, windows and two rotations), Phi-3 (Ulysses,
  a window and partial rotation), Llama 3.1 (ring, its scaled rotation at global positions), DeepSeek-V3
  (allgather, latent attention with narrower values);
* pp 2: Gemma 3 (the local layers' rotation on each stage); ZeRO-3 dp 2: Llama 3.1 (its scaled rotation);
* ep 2: DeepSeek-V3 (grouped sigmoid routing with the balancing bias, a shared expert, a dense first block).
"""

from __future__ import annotations

import pytest
import torch

from shardwise.data.tokenizer import ByteTokenizer
from shardwise.hf.export import export_model
from shardwise.hf.load import load_hf_state
from shardwise.model import Transformer
from tests.hf_families import family_directory
from tests.test_hf_train import first_batch_loss
from tests.test_train import assert_same_training, make_config, run

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                   "'shardwise[hf]'); the Hugging Face interop tests need it")

COMMON = {"model.preset": "custom", "data.seq_len": 16, "train.steps": 3, "train.lr": 1e-3}
"""Sequences of 16, beyond the toy windows of 5; a small learning rate keeps reduction-order noise under 1e-5."""
NO_AUX = {"model.moe_aux_coeff": 0.0, "model.moe_z_coeff": 0.0}
"""transformers' loss has no auxiliary losses: ours are off (the balancing bias still moves)."""

CASES = {  # family -> {run name: (nproc, overrides)}; "one" is the one-process reference where there is one
    "deepseek_v3": {"one": (1, NO_AUX), "tp2": (2, {**NO_AUX, "parallel.tp": 2}),
                    "ep2": (2, {**NO_AUX, "parallel.ep": 2}),
                    "cp2": (2, {**NO_AUX, "parallel.cp": 2, "parallel.cp_algorithm": "allgather"})},
    "olmo2": {"one": (1, {}), "tp2": (2, {"parallel.tp": 2})},
    "gemma2": {"one": (1, {}), "tp2-sp": (2, {"parallel.tp": 2, "parallel.sequence_parallel": True,
                                              "train.recompute": "selective"})},
    "mistral": {"one": (1, {"model.dropout": 0.1}),
                "cp2": (2, {"model.dropout": 0.1, "parallel.cp": 2, "parallel.cp_algorithm": "allgather"})},
    "gemma3_text": {"pp2": (2, {"parallel.pp": 2}), "cp2": (2, {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"})},
    "llama": {"zero3": (2, {"parallel.zero": 3}), "cp2": (2, {"parallel.cp": 2, "parallel.cp_algorithm": "ring"})},
    "qwen3": {"tp2": (2, {"parallel.tp": 2})},
    "phi3": {"cp2": (2, {"parallel.cp": 2, "parallel.cp_algorithm": "ulysses"})},
}


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {kind: family_directory(kind, root / kind) for kind in CASES}


@pytest.mark.parametrize("kind", list(CASES))
def test_family_trains_the_same_under_its_layouts(kind, directories, tmp_path, cache_dir):
    src = directories[kind]
    runs = {}
    for name, (nproc, overrides) in CASES[kind].items():
        given = {**COMMON, "model.init_from": f"hf:{src}", **overrides}
        runs[name] = run(tmp_path, cache_dir, name, nproc, **given)
        if not given.get("model.dropout"):
            cfg = make_config(tmp_path / f"ref-{name}", cache_dir, nproc, **given)
            expected = first_batch_loss(cfg, transformers.AutoModelForCausalLM.from_pretrained(src))
            assert runs[name][0][0] == pytest.approx(expected, abs=1e-5), name
    if "one" not in runs:
        return
    for name, result in runs.items():
        if name != "one":
            assert_same_training(result, runs["one"], atol=1e-5)
    # the trained model, exported, is the same function in transformers
    cfg = make_config(tmp_path / "export-cfg", cache_dir, 1, **{**COMMON, "model.init_from": f"hf:{src}",
                                                                **CASES[kind]["one"][1]})
    ours = Transformer(cfg.model)
    ours.load_state_dict(runs["one"][1])
    assert not torch.equal(runs["one"][1]["tok_emb.weight"], load_hf_state(src, cfg.model)["tok_emb.weight"])
    out = export_model(ours.state_dict(), cfg.model, ByteTokenizer(), tmp_path / "exported")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(theirs(tokens).logits, ours.eval()(tokens), atol=1e-5, rtol=0)
