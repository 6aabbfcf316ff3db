"""What users see in the terminal: tables and progress bars (rich), in one place."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text


# Piped output (CI logs, `| tee`) gets wide tables instead of rich's 80-column default.
console = Console() if Console().is_terminal else Console(width=160)
error_console = Console(stderr=True)


def print_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    table = Table(title=title, header_style="bold")
    for column in columns:
        table.add_column(column, justify="left" if column == columns[0] else "right")
    for row in rows:  # cells as plain text: a path or name with "[...]" in it is not rich markup
        table.add_row(*(Text(format_cell(value)) for value in row))
    console.print(table)


def format_cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.2e}"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def progress_bar(transient: bool = False) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=error_console,
        transient=transient,
    )
