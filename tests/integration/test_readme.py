"""The README's Python examples run as printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, re.S)


def test_readme_has_examples() -> None:
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"  # as a user runs it: a file, so its __main__ has a path
    script.write_text(code)
    try:  # within the test's own timeout, so that a hang still shows what the example printed
        result = subprocess.run(
            [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=100
        )
    except subprocess.TimeoutExpired as hung:
        output = (hung.stdout or b"")[-3000:], (hung.stderr or b"")[-3000:]
        pytest.fail(f"the example did not finish in 100 s; stdout, stderr: {output}")
    assert result.returncode == 0, result.stderr[-2000:]
