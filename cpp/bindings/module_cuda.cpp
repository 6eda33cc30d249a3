// lowfp._C_cuda: the CUDA backend, with lowfp._C's quantize signature (def_quantize.hpp); the device
// index and the stream (torch.cuda.current_stream().cuda_stream) say where kernels are enqueued,
// and nothing waits for them.
#include <pybind11/pybind11.h>

#include "accumulate_cuda.hpp"
#include "def_accumulate.hpp"
#include "def_extra_bits.hpp"
#include "def_quantize.hpp"
#include "def_scaled.hpp"
#include "rounding_kernels.hpp"
#include "extra_bits_cuda.hpp"
#include "quantize_cuda.hpp"
#include "s2fp8_cuda.hpp"
#include "scaled_cuda.hpp"

namespace {

void run_scaled(const lowfp::ScaledCall& call, const lowfp::NoForms&, double* tensor_scale, int64_t* counts,
                int device, uintptr_t stream) {
  lowfp::scaled_cuda(call, tensor_scale, counts, device, stream);
}

using CudaRounding = lowfp::ModuleRounding<lowfp::NoForms, &lowfp::quantize_cuda, &run_scaled>;

}  // namespace

PYBIND11_MODULE(_C_cuda, mod) {
  mod.doc() = "lowfp CUDA core (raw-buffer interface; use the lowfp package)";
  lowfp::def_contract(mod);
  lowfp::def_quantize(mod, &lowfp::quantize_cuda);
  // the roundings that lowfp._C's one-call paths run on CUDA tensors (rounding_kernels.hpp)
  mod.attr("ROUNDING_KERNELS") =
      pybind11::capsule(static_cast<const void*>(&CudaRounding::kernels), lowfp::kRoundingKernelsCapsule);
  lowfp::def_s2fp8(mod, &lowfp::s2fp8_cuda);
  lowfp::def_scaled<lowfp::NoForms>(
      mod, [](const lowfp::ScaledRequest&, const lowfp::ScaledCall&) { return lowfp::NoForms{}; }, &run_scaled);
  lowfp::def_hadamard(mod, &lowfp::hadamard_cuda);
  lowfp::def_accumulate(mod, &lowfp::accumulate_cuda);
  lowfp::def_extra_bits(mod, &lowfp::extra_bits_split_cuda, &lowfp::extra_bits_merge_cuda,
                        &lowfp::extra_bits_step_cuda);
  // lowfp._C's count_unchanged on the device, enqueued on `stream` of `device`.
  mod.def("count_unchanged", [](uintptr_t x, int32_t dtype, int64_t n, uintptr_t counts, int device,
                                uintptr_t stream) {
    if (dtype < 0 || dtype > 3) throw std::invalid_argument("bad dtype code");
    if (n < 0) throw std::invalid_argument("negative element count");
    lowfp::count_unchanged_cuda(lowfp::DType(dtype), reinterpret_cast<const void*>(x), n,
                                reinterpret_cast<int64_t*>(counts), device, stream);
  });
  // lowfp._C's any_non_finite on the device, with the zeroed scratch words it keeps zero
  // (any_non_finite_cuda) and the device and stream that run it.
  mod.def("any_non_finite", [](uintptr_t x, int32_t dtype, int64_t n, uintptr_t out,
                               uintptr_t counts, int64_t n_counts, uintptr_t scratch, int device,
                               uintptr_t stream) {
    if (dtype < 0 || dtype > 3) throw std::invalid_argument("bad dtype code");
    lowfp::any_non_finite_cuda(lowfp::DType(dtype), reinterpret_cast<const void*>(x), n,
                               reinterpret_cast<bool*>(out), reinterpret_cast<int64_t*>(counts),
                               n_counts, reinterpret_cast<uint32_t*>(scratch), device, stream);
  });
}
