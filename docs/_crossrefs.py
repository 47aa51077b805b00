"""Griffe extension for the docs build: links the backticked package names in
docstrings.

Docstrings name other objects plainly, as `graphax_eqx.jacve`, so that they read well
in `help()`. On the site each such name becomes a cross-reference to the object's
documentation (and `mkdocs build --strict` fails if that object is not documented).
"""

import re

import griffe


# A whole backticked dotted name, not already the title of a Markdown link.
_NAME = re.compile(r"(?<![\[\w.])`(graphax_eqx(?:\.\w+)+)`(?!\])")


class CrossReferences(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        del kwargs
        if obj.docstring is not None:
            obj.docstring.value = _NAME.sub(r"[`\1`][\1]", obj.docstring.value)
