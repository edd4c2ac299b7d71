"""VocabPartition and shard_tensor: pure arithmetic, no process group."""

import random

import pytest
import torch

from vp_accelerate.vocab.partition import VocabPartition, shard_tensor


@pytest.mark.parametrize("trial", range(20))
def test_shards_cover_the_vocabulary_exactly_once(trial):
    p = random.randint(1, 9)
    V = random.randint(p, 5000)
    pad = random.choice([1, 1, 8, 64])
    part = VocabPartition(V, p, pad)
    msg = f"V={V} p={p} pad={pad}"
    assert part.shard_size % pad == 0, msg
    assert part.padded_size == part.shard_size * p >= V, msg
    assert part.shard_size - pad < -(-V // p) <= part.shard_size, msg  # minimal padding
    covered = []
    for r in range(p):
        start, end = part.shard_range(r)
        assert end - start == part.shard_size, msg
        covered += list(range(start, start + part.valid_rows(r)))
    assert covered == list(range(V)), msg


def test_known_layout_with_an_empty_shard():
    part = VocabPartition(9, 4, pad_multiple=4)  # 3 rows each, padded to 4: the last rank holds only padding
    assert part.shard_size == 4 and part.padded_size == 16
    assert [part.shard_range(r) for r in range(4)] == [(0, 4), (4, 8), (8, 12), (12, 16)]
    assert [part.valid_rows(r) for r in range(4)] == [4, 4, 1, 0]


def test_shard_tensor_round_trip_and_zero_padding():
    part = VocabPartition(10, 3, pad_multiple=2)  # shard 4, padded 12
    full = torch.randn(10, 5)
    shards = [shard_tensor(full, part, r) for r in range(3)]
    assert all(s.shape == (4, 5) for s in shards)
    assert torch.equal(torch.cat(shards)[:10], full)
    assert torch.count_nonzero(torch.cat(shards)[10:]) == 0
    with pytest.raises(ValueError, match="rows"):
        shard_tensor(torch.randn(11, 5), part, 0)


def test_errors_name_the_cause():
    with pytest.raises(ValueError, match=r"vocab_size \(3\) < world_size \(4\)"):
        VocabPartition(3, 4)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        VocabPartition(10, 0)
    with pytest.raises(ValueError, match="pad_multiple"):
        VocabPartition(10, 2, pad_multiple=0)
    with pytest.raises(ValueError, match="rank 2 outside"):
        VocabPartition(10, 2).shard_range(2)
