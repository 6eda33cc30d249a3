// One module's rounding kernels as lowfp._C's one-call paths (def_bound_round.hpp) run them: the
// CPU's (lowfp._C) and, handed from one extension module to the other in a PyCapsule
// (lowfp._C_cuda.ROUNDING_KERNELS, named kRoundingKernelsCapsule, which lowfp.quantize passes to
// lowfp._C.round_bound_setup), CUDA's. Each module's prepared requests are classes of its own
// (module_local), so only that module can tell them and read them: ModuleRounding is instantiated
// in the module's translation unit. Both modules are built from these headers in one build, so
// they agree on QuantizeCall's and ScaledCall's layouts.
#pragma once
#include <Python.h>
#include <pybind11/pybind11.h>

#include <cstdint>

#include "def_quantize.hpp"
#include "def_scaled.hpp"

namespace lowfp {

struct RoundingKernels {
  // Whether `request` is a PreparedQuantize of the module; if so, its call into *call.
  bool (*prepared_call)(PyObject* request, QuantizeCall* call);
  // The call run (on the CPU) or enqueued on `stream` of `device` (nothing waits for it).
  // Called without the GIL.
  void (*run)(const QuantizeCall& call, int64_t* counts, int device, uintptr_t stream);
  // Whether `request` is a PreparedScaled of the module; if so, its call into *call and the
  // backend's forms into *forms (valid while the request lives).
  bool (*prepared_scaled)(PyObject* request, ScaledCall* call, const void** forms);
  // A scaled call with its buffers (with_buffers), as run_scaled's caller in def_scaled runs it.
  // Called without the GIL.
  void (*run_scaled)(const ScaledCall& call, const void* forms, double* tensor_scale, int64_t* counts, int device,
                     uintptr_t stream);
};

inline constexpr const char* kRoundingKernelsCapsule = "lowfp._C_cuda.ROUNDING_KERNELS";

// The RoundingKernels of the module whose translation unit instantiates it: Run and RunScaled are
// its kernels' entry points (RunScaled with its scaled requests' Forms).
template <class Forms, void (*Run)(const QuantizeCall&, int64_t*, int, uintptr_t),
          void (*RunScaled)(const ScaledCall&, const Forms&, double*, int64_t*, int, uintptr_t)>
struct ModuleRounding {
  static bool prepared_call(PyObject* request, QuantizeCall* call) {
    const pybind11::handle h(request);
    if (!pybind11::isinstance<PreparedQuantize>(h)) return false;
    *call = h.cast<const PreparedQuantize&>().call;
    return true;
  }
  static bool prepared_scaled(PyObject* request, ScaledCall* call, const void** forms) {
    const pybind11::handle h(request);
    if (!pybind11::isinstance<PreparedScaled<Forms>>(h)) return false;
    const auto& p = h.cast<const PreparedScaled<Forms>&>();
    *call = p.call;
    *forms = &p.forms;
    return true;
  }
  static void run_scaled(const ScaledCall& call, const void* forms, double* tensor_scale, int64_t* counts, int device,
                         uintptr_t stream) {
    RunScaled(call, *static_cast<const Forms*>(forms), tensor_scale, counts, device, stream);
  }
  static constexpr RoundingKernels kernels{&prepared_call, Run, &prepared_scaled, &run_scaled};
};

}  // namespace lowfp
