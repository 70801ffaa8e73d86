"""One module per schedule; importing this package registers them all."""
from jax_flash.schedules import cpu, decode, v1, v2, v3  # noqa: F401
from jax_flash.schedules.base import Schedule, registered  # noqa: F401
