import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One OpenMP thread for a module's in-process training: with other processes on the 2 cores, 2 threads
    spin-wait and run ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
