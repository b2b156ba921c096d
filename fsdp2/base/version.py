"""The package's version and the torch release its test suite runs on: one
place, read by the build (pyproject.toml), ``summary``'s table and the
engine's internal-error messages (what a bug report needs)."""

__version__ = "0.1.0"
TESTED_TORCH = "2.13.0"


def versions() -> str:
    """``fsdp2 <version>, torch <running> (tested with <TESTED_TORCH>)``, for reports."""
    import torch

    return f"fsdp2 {__version__}, torch {torch.__version__} (tested with {TESTED_TORCH})"
