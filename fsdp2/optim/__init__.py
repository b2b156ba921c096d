"""The optimizer side: torch's elementwise optimizers stepped on the local
tensors (local_step.py) and the hooks around every step (optimizer_hooks.py),
gradient clipping (clip.py, and torch's own routed by the install in
torch_clipping.py), and optimizers that need whole matrices on sharded
parameters (``Muon``: muon.py, exchange.py, owners.py, newton_schulz.py)."""

from .muon import Muon
from .owners import assign_owners, newton_schulz_cost

__all__ = ["Muon", "assign_owners", "newton_schulz_cost"]
