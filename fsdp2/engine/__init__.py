"""The engine: a parameter sharded, gathered and given its gradient
(``FSDPParam``), the group of one ``fully_shard`` call and its two state
machines (``FSDPParamGroup``), the gradient reduction pipeline, the context
one root shares with everything under it, the autograd hook after backward
(post_backward.py), the state-dict hooks and the execution-order check. The
module hooks that drive it are ``FSDPState``'s (api/state.py)."""
