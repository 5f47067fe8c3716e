"""Tensor and sequence parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022): everything of one technique.

* :mod:`.layers` -- column / row / vocabulary-parallel layers and the sequence-parallel mode;
* :mod:`.loss` -- the vocabulary-parallel cross-entropy, returning ``(sum, count)``;
* :mod:`.plan` -- which module of each flavour gets which form, and the rewrite that applies it;
* :mod:`.state` -- this rank's checkpoint pieces (rows of the single-process tensors) and their loading;
* :mod:`.checks` -- the config rules of tp and sp, functions of the config alone.

The package imports nothing itself, so that the checks load without torch.
"""
