"""docs/CLIENT.md's Python examples, run as they are against a real broker, so the library's
documentation cannot drift.

Every fenced block whose info string is ``python example`` runs in a fresh interpreter
against a fresh broker (its address in place of 127.0.0.1:7878), and what it prints must
equal the ``text`` block that follows it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "CLIENT.md"
_BLOCK = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```\n", re.M | re.S)


def examples() -> list[tuple[str, str]]:
    """(script, expected output) of each runnable example, in the document's order."""
    blocks = [(m.group("info").strip(), m.group("body"))
              for m in _BLOCK.finditer(DOC.read_text())]
    out = []
    for i, (info, body) in enumerate(blocks):
        if info != "python example":
            continue
        if i + 1 == len(blocks) or blocks[i + 1][0] != "text":
            raise AssertionError(f"example {body.splitlines()[0]!r} has no text block after "
                                 "it with its output")
        out.append((body, blocks[i + 1][1]))
    return out


_EXAMPLES = examples()


def test_the_client_docs_have_runnable_examples_of_both_clients() -> None:
    assert len(_EXAMPLES) >= 5
    assert any("AsyncClient(" in s for s, _ in _EXAMPLES)
    assert any("with Client(" in s for s, _ in _EXAMPLES)


@pytest.mark.parametrize(("script", "expected"), _EXAMPLES,
                         ids=[f"example{i}" for i in range(len(_EXAMPLES))])
def test_client_doc_example(start_broker, tmp_path: Path, script: str, expected: str) -> None:
    b = start_broker()
    path = tmp_path / "example.py"
    path.write_text(script.replace("127.0.0.1:7878", b.addr))
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected
