// Registers the CPU kernels of the hadw_cpp:: ops when Python imports
// hadw_kernels._cpu_kernels. The schemas are defined by hadw_kernels/ops/schemas.py; the
// dispatcher accepts kernels registered before or after the schema, and checks them
// against it when both exist, so the import order of the two does not matter.
// hadw_kernels/backends/cpp_backend.py makes these the "cpp" kernels of the hadw:: ops.
//
// Built against Python's limited API (no pybind11): the module's import runs the static
// registration below. Its attributes: CONFIG, the JSON of the config.py constants it was
// compiled with (build/generated/hadw_config.h), which the backend checks against the
// running config.py; SCHEMAS, the digest of the op signatures it was declared against
// (build/generated/kernels.h), which the backend reads from the file before importing it;
// ROW_KERNELS, "avx512" or "portable" (csrc/tile_math.h).

#include <Python.h>
#include <torch/library.h>

#include "hadw_config.h"
#include "kernels.h"

TORCH_LIBRARY_IMPL(hadw_cpp, CPU, m) {
  m.impl("surrogate_loss", &hadw::surrogate_loss_cpu);
  m.impl("linear_logprob_forward", &hadw::linear_logprob_forward_cpu);
  m.impl("linear_logprob_backward", &hadw::linear_logprob_backward_cpu);
  m.impl("linear_surrogate_forward", &hadw::linear_surrogate_forward_cpu);
}

extern "C" PyObject* PyInit__cpu_kernels(void) {
  static PyModuleDef module_definition = {
      PyModuleDef_HEAD_INIT,
      "_cpu_kernels",
      "CPU kernels of the hadw_cpp:: ops (registered with the PyTorch dispatcher on import).",
      -1,       // no per-module state
      nullptr,  // no functions
      nullptr,
      nullptr,
      nullptr,
      nullptr,
  };
  PyObject* module = PyModule_Create(&module_definition);
  if (module != nullptr && (PyModule_AddStringConstant(module, "CONFIG", hadw::config::kFingerprint) != 0 ||
                            PyModule_AddStringConstant(module, "SCHEMAS", hadw::kSchemas) != 0 ||
                            PyModule_AddStringConstant(module, "ROW_KERNELS", hadw::row_kernels()) != 0)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
