"""Simulate a training step before renting the cluster: the engine's own pipeline schedules, buckets and ZeRO
units, and every technique's collectives, timed on a modelled cluster (roofline GPUs, NVLink, rail-optimised
NICs, a fat tree shared max-min fairly). ``shardwise simulate``; see :mod:`shardwise.sim.simulate`.
"""
