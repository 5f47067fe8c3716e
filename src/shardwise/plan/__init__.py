"""Calculators and planner: parameters, FLOPs, memory, communication and time; layout search.

Modules: ``spec`` (model shape and layout), ``params``, ``flops``, ``memory``, ``comm``, ``perf``
(step time), ``hardware`` (GPU catalogue, cluster), ``search``, ``report``, ``compare``, ``cli``.
"""

from shardwise.plan.flops import flops_per_token, megatron_flops_per_iteration
from shardwise.plan.hardware import Cluster, find_gpu, load_catalogue
from shardwise.plan.memory import STATE_CONVENTIONS, StateDtypes, memory_breakdown, zero_model_states
from shardwise.plan.params import closed_form_params, count_params
from shardwise.plan.spec import Layout, ModelSpec, model_spec

__all__ = ["Cluster", "Layout", "ModelSpec", "STATE_CONVENTIONS", "StateDtypes", "closed_form_params",
           "count_params", "find_gpu", "flops_per_token", "load_catalogue", "megatron_flops_per_iteration",
           "memory_breakdown", "model_spec", "zero_model_states"]
