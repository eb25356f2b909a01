"""Every Python snippet of docs/migration.md runs, and the guide covers every name torch has.

Snippets run as written: single-process ones in this process (warnings are errors here, as
everywhere in the suite), and one whose first line is ``# torchrun --nproc-per-node N``
under torchrun with N local ranks.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint.staging as torch_staging

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "migration.md"
TORCHRUN = re.compile(r"# torchrun --nproc-per-node (\d+)\n")


def snippets() -> list[tuple[str, str]]:
    """(section heading + index, code) of every ```python block in the guide."""
    found: list[tuple[str, str]] = []
    heading = "top"
    for part in re.split(r"(^#+ .*$|^```python\n(?s:.*?)^```$)", GUIDE.read_text(), flags=re.M):
        if part.startswith("#"):
            heading = part.lstrip("# ").strip("`")
        elif part.startswith("```python"):
            found.append((f"{heading}-{sum(h.startswith(heading) for h, _ in found)}", part[10:-3]))
    return found


SNIPPETS = snippets()


def test_the_guide_has_snippets_to_run() -> None:
    assert len(SNIPPETS) >= 7
    assert sum(bool(TORCHRUN.match(code)) for _, code in SNIPPETS) == 1


def test_every_torch_staging_name_and_async_save_has_a_section() -> None:
    headings = set(re.findall(r"^## `([^`]+)`$", GUIDE.read_text(), flags=re.M))
    assert {*torch_staging.__all__, "_ReplicationStager", "dcp.async_save"} <= headings


@pytest.mark.parametrize(("name", "code"), SNIPPETS, ids=[name for name, _ in SNIPPETS])
def test_snippet_runs(name: str, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ranks = TORCHRUN.match(code)
    if ranks:
        script = tmp_path / "snippet.py"
        script.write_text(code)
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             ranks.group(1), str(script)],
            cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert "holds rank" in done.stdout
        return
    try:
        exec(compile(code, f"{GUIDE.name}:{name}", "exec"), {"__name__": "__main__"})
    finally:
        assert not dist.is_initialized(), "the snippet left a process group behind"
