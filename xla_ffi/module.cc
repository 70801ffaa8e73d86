// The nanobind module jax_flash._jax_flash_ext: hands every FFI target registered by the
// handler translation units (registry.h) to Python, which registers them with XLA.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "xla_ffi/cpu/attention.h"
#include "xla_ffi/registry.h"

namespace nb = nanobind;

NB_MODULE(_jax_flash_ext, m) {
  m.doc() = "jax_flash FFI targets; import jax before this module.";

  m.def(
      "targets",
      [] {
        nb::dict result;
        for (const jax_flash::FfiTarget& target : jax_flash::ffi_targets()) {
          result[target.name.c_str()] = nb::make_tuple(
              target.platform, nb::capsule(reinterpret_cast<void*>(target.handler)));
        }
        return result;
      },
      "{target name: (platform, PyCapsule of the XLA_FFI_Handler)}; platform is 'cpu' or "
      "'CUDA'.");

  m.def(
      "has_cuda",
      [] {
#ifdef JAX_FLASH_WITH_CUDA
        return true;
#else
        return false;
#endif
      },
      "Whether the extension was built with the CUDA kernels (nvcc was found).");

  m.def("cpu_kernel_variants", &jax_flash::cpu::SupportedVariants,
        "Instruction-set variants of the CPU kernel this machine can run, best first.");
  m.def("cpu_kernel_variant", &jax_flash::cpu::ActiveVariant,
        "The variant the CPU targets use (the best one unless set_cpu_kernel_variant changed it).");
  m.def(
      "set_cpu_kernel_variant",
      [](const std::string& name) {
        if (!jax_flash::cpu::SetActiveVariant(name))
          throw nb::value_error(("unknown or unsupported CPU kernel variant: " + name).c_str());
      },
      nb::arg("name"), "Select a variant from cpu_kernel_variants() (for tests and benchmarks).");
}
