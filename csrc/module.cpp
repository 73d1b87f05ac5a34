// Registers the CPU kernels of the hadw:: ops when Python imports
// hadw_kernels._cpu_kernels. The schemas are defined by hadw_kernels/ops.py; the
// dispatcher accepts kernels registered before or after the schema, and checks them
// against it when both exist, so the import order of the two does not matter.
//
// Built against Python's limited API (no pybind11): the module has no functions, its
// import only runs the static registration below, and one build serves every CPython 3.

#include <Python.h>
#include <torch/library.h>

#include "kernels.h"

TORCH_LIBRARY_IMPL(hadw, CPU, m) {
  m.impl("surrogate_loss", &hadw::surrogate_loss_cpu);
  m.impl("linear_logprob_forward", &hadw::linear_logprob_forward_cpu);
  m.impl("linear_logprob_backward", &hadw::linear_logprob_backward_cpu);
}

extern "C" PyObject* PyInit__cpu_kernels(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT,
      "_cpu_kernels",
      "CPU kernels of the hadw:: ops (registered with the PyTorch dispatcher on import).",
      -1,       // no per-module state
      nullptr,  // no functions
      nullptr,
      nullptr,
      nullptr,
      nullptr,
  };
  return PyModule_Create(&module);
}
