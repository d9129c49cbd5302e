"""The README's quick-start snippet, run exactly as written against a real server on its default address."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvstore.server.process import ServerProcess

README = Path(__file__).resolve().parent.parent / "README.md"


def quickstart() -> str:
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README has no python block under 'Quick start'"
    return match.group(1)


def test_readme_quickstart_runs_as_written() -> None:
    code = quickstart()
    assert '"127.0.0.1:7600"' in code  # the snippet talks to the default address
    with ServerProcess("--port", "7600", "--capacity", "64MiB"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "stored 4 existed 0" in out.stdout
    assert "prefix hit: 4 blocks" in out.stdout
