#!/bin/bash
# Builds tests/gpu/harness_v3_bwd.cu with -DJAX_FLASH_V3_BWD_TIMELINE into
# .carry/harness_v3_bwd_timeline: build_v3_bwd.sh's objects, with the main backward kernel
# stamping a timeline (cuda/v3.h, v3_bwd_timeline) and the harness's --timeline mode. A
# measurement build only: the library and build_v3_bwd.sh never define the macro.
#   bash tests/gpu/build_v3_bwd_timeline.sh            (CUTLASS=<include dir> to override)
# Spills of the instrumented kernels, nvcc 13.0: as the default build (H = 64 main kernels 8
# bytes stored, 24 / 32 loaded; none elsewhere) plus 4 / 4 bytes in each H = 128 main kernel,
# one register around the helper's softcap branch (not run by the --timeline configs).
HARNESS_FLAGS=-DJAX_FLASH_V3_BWD_TIMELINE HARNESS_NAME=harness_v3_bwd_timeline \
  exec bash "$(dirname "$0")/build_v3_bwd.sh"
