"""The mistake checks: a model that would train silently wrong is refused
with a message that names the fix. Every rank holds the same model at the
first forward (same_model.py); an optimizer built before ``fully_shard`` or
while parameters were unsharded, an unsharded root, parameters replaced
behind the engine's back (mistakes.py)."""
