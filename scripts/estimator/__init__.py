"""scripts/estimate.py's model of a step, by concept: ``sizes`` (the presets,
the run's setup, fsdp2's shard sizes over a fake process group), ``comm``
(the collectives, the links they cross, compression) and ``memory`` (the
peak's moments and the activations of a meta step). The module docstring of
scripts/estimate.py states the model."""
