import os

import pytest
import torch

# Every test runs under NCCL's p2p semantics emulated on gloo (runtime/p2p.py): one Work per batch,
# sends that wait for the peer's receive, a rank's batches in issue order. Spawned ranks and launched
# training runs inherit it, so an order that would hang a multi-GPU launch fails here.
os.environ.setdefault("VP_STRICT_P2P", "1")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls run faster on one thread (several threads on a busy 2-core box wait on each other);
    spawned ranks set their own thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
