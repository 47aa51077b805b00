"""The Python code blocks of README.md and docs/*.md run as written.

The blocks of one page run in order in one namespace, as a reader pasting them into
one session would; each page is one test. A block preceded by the HTML comment
`<!-- skip -->` (invisible on the rendered page) is not run: keep that for code that
cannot run here, such as code that needs several devices, and say why in the text.
"""

import pathlib
import re
import textwrap

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(
    r"(?P<skip><!--\s*skip\s*-->[ \t]*\n(?:[ \t]*\n)*)?"
    r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<code>.*?)^(?P=indent)```",
    re.MULTILINE | re.DOTALL,
)


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """`(line, source, skipped)` for each ```python block of a Markdown page."""
    blocks = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start("code"))  # the fence's line, 1-based
        code = textwrap.dedent(match.group("code"))
        blocks.append((line, code, match.group("skip") is not None))
    return blocks


def test_collector():
    page = """Text.

```python
a = 1
```

<!-- skip -->
```python
raise RuntimeError
```

- A list item:

    ```python
    b = a + 1
    ```

```bash
echo not python
```
"""
    assert python_blocks(page) == [
        (3, "a = 1\n", False),
        (8, "raise RuntimeError\n", True),
        (14, "b = a + 1\n", False),
    ]


def test_pages_have_blocks():
    # Guards the collector against silently finding nothing.
    counts = {page.name: len(python_blocks(page.read_text("utf-8"))) for page in PAGES}
    assert counts["README.md"] >= 2
    assert counts["getting_started.md"] >= 5
    assert counts["sparse.md"] >= 5


@pytest.fixture
def headless_matplotlib():
    try:
        import matplotlib
    except ImportError:  # pages that plot fail on import, with a clear message
        yield
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_page_runs(page, tmp_path, monkeypatch, headless_matplotlib):
    # Blocks that save files write them here, not into the checkout.
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for line, source, skipped in python_blocks(page.read_text("utf-8")):
        if skipped:
            continue
        # Line numbers in tracebacks are those of the page.
        code = compile("\n" * line + source, str(page), "exec")
        exec(code, namespace)
