"""PipelineModel.describe(): a RankLayout whose fields say what each rank holds and whose text is the
line the README shows; the trainer's checkpoint fingerprint is built from those fields."""

import json
import subprocess
import sys

import pytest

from helpers.tiny import tiny_config
from vp_accelerate.distributed import spawn
from vp_accelerate.runtime import PipelineLayout, RankLayout

CASES = {  # (schedule, method, tied)
    "1f1b-vocab2": ("1f1b", "vocab-2", False),
    "1f1b-baseline-tied": ("1f1b", "baseline", True),
    "interleaved-vocab2-tied": ("interleaved", "vocab-2", True),
}


def _describe_on_ranks():
    from vp_accelerate.runtime import PipelineConfig, PipelineModel

    out = {}
    for name, (schedule, method, tied) in CASES.items():
        config = tiny_config("llama", vocab_size=257, num_layers=4, tie=tied)
        pipe = PipelineModel(config, PipelineConfig(schedule=schedule, method=method, microbatches=2))
        layout = pipe.describe()
        count = sum(p.numel() for p in pipe.parameters())
        out[name] = (layout, count, pipe.param_bytes())
        pipe.close()
    return out


@pytest.fixture(scope="module")
def layouts():
    per_rank = spawn(_describe_on_ranks, 2, timeout_s=300)
    return {name: [r[name] for r in per_rank] for name in CASES}


EXPECTED = {  # describe()'s text without the size; 257 rows split 129 + 128
    "1f1b-vocab2": [
        "rank 0 (pp 0/2, dp 0/1): chunk 0: layers 0-1; vocab rows 0-128 of 257 (embedding + lm_head)",
        "rank 1 (pp 1/2, dp 0/1): chunk 1: layers 2-3; vocab rows 129-256 of 257 (embedding + lm_head)",
    ],
    "1f1b-baseline-tied": [
        "rank 0 (pp 0/2, dp 0/1): chunk 0: layers 0-1; full embedding",
        "rank 1 (pp 1/2, dp 0/1): chunk 1: layers 2-3; norm + full lm_head + loss",
    ],
    "interleaved-vocab2-tied": [
        "rank 0 (pp 0/2, dp 0/1): chunk 0: layers 0-0, chunk 2: layers 2-2; vocab rows 0-128 of 257 (embedding + tied)",
        "rank 1 (pp 1/2, dp 0/1): chunk 1: layers 1-1, chunk 3: layers 3-3; vocab rows 129-256 of 257 (embedding + tied)",
    ],
}


@pytest.mark.parametrize("name", list(CASES))
def test_text_is_the_readme_line(layouts, name):
    for (layout, count, nbytes), expected in zip(layouts[name], EXPECTED[name]):
        assert isinstance(layout, RankLayout)
        assert layout.text(params=False) == expected
        assert str(layout) == f"{expected}; {nbytes / 2**20:.1f} MiB of parameters"
        assert layout.param_count == count and layout.param_bytes == nbytes == 4 * count  # float32
    pipeline = PipelineLayout(tuple(r[0] for r in layouts[name]))
    assert str(pipeline).splitlines() == [str(r[0]) for r in layouts[name]]


@pytest.mark.parametrize("name", list(CASES))
def test_fields_cover_the_model(layouts, name):
    ranks = [r[0] for r in layouts[name]]
    chunks = sorted((c for r in ranks for c in r.chunks), key=lambda c: c.chunk)
    assert [c.chunk for c in chunks] == list(range(len(chunks)))
    assert [(c.start, c.end) for c in chunks] == [
        (i * 4 // len(chunks), (i + 1) * 4 // len(chunks)) for i in range(len(chunks))
    ]
    if CASES[name][1].startswith("vocab"):
        rows = [r.vocab_rows for r in ranks]
        assert rows[0][0] == 0 and rows[-1][1] == 257 and rows[0][1] == rows[1][0]
        assert not any(r.full_embedding or r.full_head for r in ranks)
    else:
        assert [(r.vocab_rows, r.full_embedding, r.full_head) for r in ranks] == [
            (None, True, False),
            (None, False, True),
        ]


def test_placement_survives_json_and_sees_layout_changes(layouts):
    """The fingerprint reads back from a checkpoint's JSON equal, and differs when the layout differs."""
    a = PipelineLayout(tuple(r[0] for r in layouts["1f1b-vocab2"]))
    assert json.loads(json.dumps(a.placement())) == a.placement()
    assert "param_count" not in a.placement()[0] and "param_bytes" not in a.placement()[0]
    b = PipelineLayout(tuple(r[0] for r in layouts["interleaved-vocab2-tied"]))
    assert b.placement() != a.placement()


def test_an_empty_chunk_reads_no_layers():
    from vp_accelerate.models.layout import layer_span

    assert (layer_span(4, 8), layer_span(4, 5), layer_span(4, 4)) == ("layers 4-7", "layers 4-4", "no layers")


def test_the_recipe_and_the_layout_records_import_without_torch():
    # the recipe is checked (and a bad one refused) before anything heavy loads
    code = (
        "import sys, vp_accelerate.runtime, vp_accelerate.runtime.describe, vp_accelerate.train.recipe; "
        "print([m for m in ('torch', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
