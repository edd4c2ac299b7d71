"""`vp-accelerate selftest` end to end: JSON shape, passing errors, and a non-zero exit when over tolerance."""

import json

from vp_accelerate.vocab import selftest


def test_selftest_json_and_exit_status(capsys):
    # Tolerance 0 must fail (any float32 rounding exceeds it) while the errors are far under the default.
    rc = selftest.main(
        ["--nproc", "2", "--json", "--vocab", "61", "--hidden", "16", "--tokens", "24", "--tolerance", "0"]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and out["passed"] is False
    assert set(out["max_rel_error"]) == {"naive", "vocab-1", "vocab-2"}
    for modes in out["max_rel_error"].values():
        assert set(modes) == {"store", "recompute", "chunked"}
        assert all(0 < v < 1e-4 for v in modes.values()), f"seed {out['seed']}: {out['max_rel_error']}"


def test_selftest_rejects_too_small_vocab(capsys):
    assert selftest.main(["--nproc", "3", "--vocab", "2"]) == 2
    assert "must be >= --nproc" in capsys.readouterr().err
