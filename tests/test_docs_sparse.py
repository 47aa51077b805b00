"""The Python code blocks of docs/sparse.md run as written, in order, in one
namespace (as a reader pasting them into one session would)."""

import pathlib
import re

import pytest


DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "sparse.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
_MATPLOTLIB = re.compile(r"^\s*(import|from)\s+matplotlib\b", re.MULTILINE)


def _blocks() -> list[str]:
    return _BLOCK.findall(DOC.read_text(encoding="utf-8"))


def test_doc_has_python_blocks():
    assert len(_blocks()) >= 5


def test_docs_sparse_blocks_run(tmp_path, monkeypatch):
    # Blocks that save files write them here, not into the checkout.
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "docs_sparse"}
    skipped = None
    for k, source in enumerate(_blocks()):
        if _MATPLOTLIB.search(source):
            try:
                matplotlib = pytest.importorskip("matplotlib")
            except pytest.skip.Exception as skip:
                # Run the other blocks anyway; report the skip at the end.
                skipped = skip
                continue
            matplotlib.use("Agg")
        code = compile(source, f"{DOC.name}[python block {k}]", "exec")
        exec(code, namespace)
    if skipped is not None:
        raise skipped
