"""The attributes fsdp2 sets on tensors it does not own: each marks one fact
about a user's parameter, set in one place and read in another. Reading one
is a dictionary lookup, free for parameters that carry none.

- ``SHARDED``: a sharded parameter ``fully_shard`` made, with its
  ``ShardLayout`` (``fully_shard`` refuses to shard it again; the optimizer
  hooks tell it from a plain one, and a piece sharded over replicas).
- ``SHARDED_AS``: an original parameter that ``fully_shard`` replaced, with
  where, a ``ShardedAs`` (a later call, or an optimizer holding it, is refused).
- ``UNSHARDED``: an unsharded parameter fsdp2 registers on a module between
  unshard and reshard, with the sharded parameter's name (an optimizer built
  while the model was unsharded holds it: refused, its storage is freed at
  reshard).
- ``IGNORED``: passed as ``ignored_params``: plain on purpose.
- ``DATA_PARALLEL``: the ``MeshInfo`` a sharded parameter is sharded over
  (set at lazy init, for the optimizer check).
- ``KEPT_CHUNK``: ``shard_optimizer_over_replicas``: the kept chunk a piece
  built (over_replicas.py), marked stale when an optimizer steps the piece
  (optimizer_hooks.py).
- ``BUILT_AS``: on a sharded parameter, what ``fully_shard`` took of the
  parameter it replaced (its checksums, version counters), until the root's
  lazy init compares it over the ranks (same_model.py); None: not compared.
"""

SHARDED = "_fsdp2_sharded"
SHARDED_AS = "_fsdp2_sharded_as"
UNSHARDED = "_fsdp2_unsharded"
IGNORED = "_fsdp2_ignored"
DATA_PARALLEL = "_fsdp2_data_parallel"
KEPT_CHUNK = "_fsdp2_kept_chunk"
BUILT_AS = "_fsdp2_built_as"


class ShardedAs:
    """Where a parameter that ``fully_shard`` replaced went, for messages: its
    name in the sharded module (``'weight' of Embedding``), then its path from
    the root (``'embed.weight'``) once the root's lazy init has named it."""

    __slots__ = ("in_module", "path")

    def __init__(self, in_module: str) -> None:
        self.in_module = in_module
        self.path: str | None = None

    def __str__(self) -> str:
        return repr(self.path) if self.path is not None else self.in_module
