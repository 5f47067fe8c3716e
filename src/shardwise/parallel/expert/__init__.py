"""Expert parallelism (GShard, Lepikhin et al. 2021): everything of one technique.

* :mod:`.dispatch` -- each MoE block keeps its share of the experts and reaches them by all-to-all;
* :mod:`.tensor` -- each expert's hidden units split over the tensor-parallel ranks (``parallel.etp``);
* :mod:`.state` -- expert weights' checkpoint pieces under the single-process names;
* :mod:`.checks` -- the config rules of experts (MoE fields, ep and what they compose with).

The package imports nothing itself, so that the checks load without torch.
"""
