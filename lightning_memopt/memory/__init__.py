"""Memory measurement: live tensor bytes by category, device queries, byte sizes, reports."""

from lightning_memopt.memory.report import MemoryHistory, summary, write_report
from lightning_memopt.memory.tracker import CATEGORIES, MemoryTracker
from lightning_memopt.memory.units import format_bytes, parse_bytes

__all__ = [
    "CATEGORIES",
    "MemoryHistory",
    "MemoryTracker",
    "format_bytes",
    "parse_bytes",
    "summary",
    "write_report",
]
