"""A griffe extension for the API reference: Sphinx roles in docstrings become code spans.

commpress's docstrings use reStructuredText roles (``:class:`~commpress.ddp.CompressionState```,
``:mod:`.checks```), which Markdown would print as ``:class:`` followed by code. This turns each
into a plain code span, the last dotted part only where the role has ``~``, as Sphinx shows it.
Cross-references are not attempted: relative and private targets would break the strict build.
Loaded by ``mkdocs.yml`` (mkdocstrings' ``extensions`` option); the package is not changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:mod|class|func|meth|attr|data|exc|obj|const|ref|term):`(~?)([^`]+)`")


def plain(text: str) -> str:
    """Return ``text`` with every Sphinx role replaced by a Markdown code span."""

    def span(match: re.Match[str]) -> str:
        tilde, target = match.groups()
        target = target.strip()
        if "<" in target and target.endswith(">"):  # :ref:`title <target>`
            target = target[: target.index("<")].strip()
        if tilde:
            target = target.rsplit(".", 1)[-1]
        return f"`{target}`"

    return ROLE.sub(span, text)


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
