"""Optimizers that need whole matrices, on fsdp2's sharded parameters."""

from .muon import Muon
from .owners import assign_owners, newton_schulz_cost

__all__ = ["Muon", "assign_owners", "newton_schulz_cost"]
