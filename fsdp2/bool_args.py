"""Boolean arguments, checked strictly: ``True`` or ``False`` and nothing else.

A config value such as ``"false"`` is truthy and ``1`` or ``2.5`` only look
like flags, so taking them as booleans would silently turn an option on. Every
boolean keyword of ``fully_shard``, of its policies and of ``FSDPModule``'s
setters goes through ``check_bool``.
"""


def check_bool(where: str, name: str, value: object, hint: str = "") -> bool:
    """``value`` if it is a ``bool``; otherwise a TypeError naming ``where``
    (the function or class) and ``name`` (the argument), ending with ``hint``."""
    if not isinstance(value, bool):
        raise TypeError(
            f"{where}({name}=...) takes True or False, got {type(value).__name__} {value!r}. "
            f"Pass {name}=True or {name}=False; convert a config value first "
            f"(bool('false') is True).{hint}"
        )
    return value
