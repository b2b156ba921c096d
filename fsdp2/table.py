"""The text tables of ``summary`` and ``comm_stats``: box-drawn, each column
as wide as its widest cell (nothing is cut or wrapped, whatever the
terminal), the title above and the caption below, centred. No dependency
beyond Python, so that the package needs torch and numpy only."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(
    title: str,
    columns: Sequence[tuple[str, str]],
    rows: Sequence[Sequence[str]],
    caption: str = "",
) -> str:
    """``columns`` are ``(header, "left" | "right")``; each row has one cell per column."""
    widths = [
        max([len(header), *(len(row[i]) for row in rows)]) for i, (header, _) in enumerate(columns)
    ]

    def line(cells: Sequence[str], justify: Sequence[str]) -> str:
        padded = [
            cell.ljust(width) if side == "left" else cell.rjust(width)
            for cell, width, side in zip(cells, widths, justify, strict=True)
        ]
        return "│ " + " │ ".join(padded) + " │"

    def rule(left: str, middle: str, right: str) -> str:
        return left + middle.join("─" * (width + 2) for width in widths) + right

    sides = [side for _, side in columns]
    body = [
        rule("┌", "┬", "┐"),
        line([header for header, _ in columns], sides),
        rule("├", "┼", "┤"),
        *(line(row, sides) for row in rows),
        rule("└", "┴", "┘"),
    ]
    width = len(body[0])
    lines = [title.center(width).rstrip(), *body]
    if caption:
        lines.append(caption.center(width).rstrip())
    return "\n".join(lines)
