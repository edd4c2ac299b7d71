import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls run faster on one thread (several threads on a busy 2-core box wait on each other);
    spawned ranks set their own thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
