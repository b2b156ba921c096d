"""Boolean arguments, read as torch's fully_shard reads them, minus its traps.

torch tests its flags for truth, so it gives a meaning to ``0``/``1`` and
other numbers (numpy's too), numpy's booleans and ``None`` (False): fsdp2
takes those too, with that meaning (docs/usage.md, "Arguments torch
accepts"). It refuses a string or bytes, because ``"false"`` is true and
would silently turn an option on, and any other object. Every
boolean keyword of ``fully_shard``, of its policies and of ``FSDPModule``'s
setters goes through ``check_bool``, and the code uses the bool it returns.
"""

import numbers

import numpy as np  # torch has imported it already


def check_bool(
    where: str, name: str, value: object, hint: str = "", *, strict: bool = False
) -> bool:
    """``value`` as a bool where torch reads it as one (a bool, a number,
    ``None``; with ``strict``, where torch too takes only a bool, a bool);
    otherwise a TypeError naming ``where`` (the function or class) and
    ``name`` (the argument), ending with ``hint``."""
    if isinstance(value, bool):
        return value
    if not strict and (value is None or isinstance(value, numbers.Real | np.bool_)):
        return bool(value)
    raise TypeError(
        f"{where}({name}=...) takes True or False, got {type(value).__name__} {value!r}. "
        f"Pass {name}=True or {name}=False; convert a config value first "
        f"(bool('false') is True).{hint}"
    )
