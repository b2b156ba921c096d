"""What users call and what ``fully_shard`` attaches to their modules:
``fully_shard`` and the checks of its arguments (arguments.py,
call_modules.py, param_checks.py, mesh.py), ``FSDPState`` with the forward,
pre-backward and lazy-init hooks that drive the engine (state.py),
``FSDPModule``'s methods (module.py, reduction_setters.py), ``summary`` and
``comm_stats``, ``install_as_torch_fsdp`` and the names of torch's FSDP state
that torch's libraries read (torch_names.py, torch_internals.py), and the
switches for checks (check_switches.py)."""
