import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    # Every test uses tiny shapes: on small CI machines a second OpenMP thread costs more than it
    # gives (3-6x slower measured on 2 shared cores).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
