"""The collectives and what they move: each process group's all-gather,
reduce-scatter and all-reduce (primitives.py), their streams, events and
timeouts, the byte counts of ``comm_stats``, where a parameter's elements sit
in their buffers (layout.py, mesh_info.py), the wire formats of compression,
the divisions of a reduction, and the variants a group picks once
(variants.py: plain, int8, a custom collective, over HSDP replicas). Knows a
parameter only as a ``CommParam`` (layout.py), never the engine's classes."""
