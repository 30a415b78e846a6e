"""A griffe extension for the docs build: the reStructuredText bits of the docstrings, as Markdown.

The package's docstrings are Google style, read in editors and ``help()`` as well as here, and use a few
reStructuredText constructs (``:class:`~x.Y``` roles, simple ``=====`` tables) that Markdown would show
verbatim. This rewrites them when mkdocstrings loads the package; the source is not touched.
"""

from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|py:\w+):`(~?)([^`]+)`")
_BORDER = re.compile(r"^(\s*)(=+)(\s+=+)+\s*$")
# "Example::" then an indented block: the block is a Markdown code block already; only the "::" shows.
# (Not "Example:", which griffe would read as a section and dedent the code into prose.)
_EXAMPLE = re.compile(r"^([ \t]*)(Examples?)::[ \t]*$", re.M)
_LITERAL = re.compile(r"(\S)::[ \t]*$", re.M)


def _role(match: re.Match) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _columns(border: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for m in re.finditer(r"=+", border)]


def _cells(line: str, cols: list[tuple[int, int]]) -> list[str]:
    # The last column runs to the end of the line (its text may be longer than its border).
    bounds = [start for start, _ in cols] + [None]
    return [line[bounds[i] : bounds[i + 1]].strip() for i in range(len(cols))]


def _table(header: list[str] | None, body: list[str], cols: list[tuple[int, int]], indent: str) -> list[str]:
    """A simple table's header cells and body lines as a Markdown table (empty header when none)."""
    rows: list[list[str]] = []
    for line in body:
        if not line.strip():
            continue
        cells = _cells(line, cols)
        if rows and not cells[0]:  # a continuation line: more text for the previous row's cells
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
        else:
            rows.append(cells)
    header = header or [""] * len(cols)
    out = [indent + "| " + " | ".join(header) + " |", indent + "|" + "---|" * len(cols)]
    out += [indent + "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return ["", *out, ""]


def rst_to_markdown(text: str) -> str:
    """``text`` with roles as code spans and simple tables as Markdown tables."""
    text = _LITERAL.sub(r"\1:", _EXAMPLE.sub(r"\1**\2:**", _ROLE.sub(_role, text)))
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = _BORDER.match(lines[i])
        closing = [j for j in range(i + 1, len(lines)) if _BORDER.match(lines[j])]
        if not match or not closing:
            out.append(lines[i])
            i += 1
            continue
        cols = _columns(lines[i])
        header = None
        if closing[0] == i + 2 and len(closing) >= 2:  # border, header, border, rows, border
            header, body, end = _cells(lines[i + 1], cols), lines[i + 3 : closing[1]], closing[1]
        else:  # border, rows, border
            body, end = lines[i + 1 : closing[0]], closing[0]
        out.extend(_table(header, body, cols, match.group(1)))
        i = end + 1
    return "\n".join(out)


class RstToMarkdown(griffe.Extension):
    """Rewrite every loaded docstring with :func:`rst_to_markdown`."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = rst_to_markdown(obj.docstring.value)
