import os

import numpy as np
import pytest


@pytest.fixture
def rng(request):
  """Fresh random data every run; the seed is in the test's failure output (JAX_FLASH_SEED
  replays it)."""
  seed = int(os.environ.get("JAX_FLASH_SEED", int.from_bytes(os.urandom(4), "little")))
  request.node.user_properties.append(("seed", seed))
  print(f"seed={seed}")
  return np.random.default_rng(seed)
