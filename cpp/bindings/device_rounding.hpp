// lowfp._C_cuda's element rounding as lowfp._C's one-call paths (def_bound_round.hpp) run it:
// two functions handed from one extension module to the other in a PyCapsule
// (lowfp._C_cuda.ROUNDING_KERNELS, named kDeviceRoundingCapsule), which lowfp.quantize passes to
// lowfp._C.round_bound_setup. Both modules are built from these headers in one build, so they
// agree on QuantizeCall's layout.
#pragma once
#include <Python.h>

#include <cstdint>

#include "quantize_call.hpp"

namespace lowfp {

struct DeviceRounding {
  // Whether `request` is a PreparedQuantize of the device module (its classes are module_local,
  // so only that module can tell); if so, its call into *call. Raises nothing.
  bool (*prepared_call)(PyObject* request, QuantizeCall* call);
  // The call enqueued on `stream` of `device`; nothing waits for it. Called without the GIL.
  void (*run)(const QuantizeCall& call, int64_t* counts, int device, uintptr_t stream);
};

inline constexpr const char* kDeviceRoundingCapsule = "lowfp._C_cuda.ROUNDING_KERNELS";

}  // namespace lowfp
