"""docs/reliability.md's trust and integrity table is scripts/reliability_cases.py's case list (so it cannot
drift), and every case gets what the table says (slow: minutes, the whole list in one process; a real launch among them)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import reliability_cases  # noqa: E402


def test_the_doc_table_is_the_script_case_list():
    with open(reliability_cases.DOC, encoding="utf-8") as f:
        doc = f.read()
    assert reliability_cases.doc_table(doc) == reliability_cases.table(), (
        "docs/reliability.md is out of date: python scripts/reliability_cases.py --write"
    )


@pytest.mark.slow
def test_every_case_gets_what_the_table_says(tmp_path):
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "ds"), "PYTHONPATH": ROOT}
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "reliability_cases.py")],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert out.returncode == 0 and out.stdout.rstrip().endswith("OK"), out.stdout[-4000:] + out.stderr[-2000:]
