"""The CPU schedule: the tiled online-softmax kernel in xla_ffi/cpu/, multi-threaded over
(batch, head, query block). It is the reference every GPU schedule is held to."""
from jax_flash.schedules.base import Schedule, register

CPU = register(Schedule(
    name="cpu",
    description="tiled online-softmax kernel on the host, threads over (batch, head, query block)",
    platform="cpu",
    forward_target="jax_flash_cpu_fwd",
    backward_target="jax_flash_cpu_bwd",
    backward_determinism="always",  # two phases, each output element written by one thread
))
