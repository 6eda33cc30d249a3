// lowfp._C_cuda: the CUDA backend. Same raw-buffer interface as lowfp._C plus the device index and
// the stream (torch.cuda.current_stream().cuda_stream); kernels are enqueued, never waited for.
#include <pybind11/pybind11.h>

#include "quantize_call.hpp"
#include "quantize_cuda.hpp"

namespace py = pybind11;
using namespace lowfp;

PYBIND11_MODULE(_C_cuda, mod) {
  mod.doc() = "lowfp CUDA core (raw-buffer interface; use the lowfp package)";
  mod.def("quantize", [](uintptr_t x, int32_t x_dtype, uintptr_t y, int32_t y_dtype, int64_t n,
                         int32_t e, int32_t m, int32_t b, int32_t specials, bool subnormals,
                         int32_t overflow, int32_t rounding, int32_t sr_bits, uint64_t seed,
                         uint64_t offset, uintptr_t counts, int32_t device, uintptr_t stream) {
    const QuantizeRequest r{{e, m, b, Specials(specials), subnormals}, Overflow(overflow),
                            Rounding(rounding), sr_bits, DType(x_dtype), DType(y_dtype), seed,
                            offset};
    const QuantizeCall call = make_quantize_call(r, reinterpret_cast<const void*>(x),
                                                 reinterpret_cast<void*>(y), n, counts != 0);
    py::gil_scoped_release release;
    quantize_cuda(call, reinterpret_cast<int64_t*>(counts), device, stream);
  });
}
