"""``--plot``: one stacked bar per option, bytes per rank by category at the option's peak (matplotlib)."""

from __future__ import annotations

from typing import Any

from lightning_memopt.memory import CATEGORIES

__all__ = ["plot_options"]


def plot_options(result: dict[str, Any], path: str) -> None:
    """Write a PNG: a bar per option that could be predicted, stacked by category, and the usable line.

    Raises:
        ImportError: Naming the extra to install when matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("--plot needs matplotlib: pip install 'lightning-memopt[plot]'") from exc
    rows = [o for o in result["options"] if o["categories"] is not None]
    if result["cheapest"] is not None:
        rows.append(result["cheapest"])
    top = max([result["usable_bytes"], *(sum(o["categories"].values()) for o in rows)])
    unit, gib = next(
        (u, b) for u, b in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if top >= b
    )
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4.5))
    bottoms = [0.0] * len(rows)
    for category in CATEGORIES:
        heights = [o["categories"][category] / gib for o in rows]
        ax.bar(range(len(rows)), heights, bottom=bottoms, label=category.replace("_", " "))
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.axhline(result["usable_bytes"] / gib, color="black", linestyle="--", label="usable")
    ax.set_xticks(range(len(rows)), [o["name"] for o in rows], rotation=30, ha="right")
    ax.set_ylabel(f"{unit} per rank at the step's peak")
    ax.set_title(f"{result['model']}: predicted peak memory per option")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
