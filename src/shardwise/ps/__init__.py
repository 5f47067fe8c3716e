"""Parameter server: sharded servers, push/pull, BSP / ASP / SSP, priority scheduling, stragglers.

partition (key ranges) -> server (AdamW on a key range) / worker (pull, compute, push from hooks) ->
consistency (when pushes apply and pulls answer) -> scheduling (which push goes next); protocol is the
wire format; runner is ``shardwise train`` with ``ps.servers > 0``.
"""
