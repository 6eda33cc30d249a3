// lowfp._C_cuda: the CUDA backend, with lowfp._C's quantize signature (def_quantize.hpp); the device
// index and the stream (torch.cuda.current_stream().cuda_stream) say where kernels are enqueued,
// and nothing waits for them.
#include <pybind11/pybind11.h>

#include "def_extra_bits.hpp"
#include "def_quantize.hpp"
#include "extra_bits_cuda.hpp"
#include "quantize_cuda.hpp"

PYBIND11_MODULE(_C_cuda, mod) {
  mod.doc() = "lowfp CUDA core (raw-buffer interface; use the lowfp package)";
  lowfp::def_quantize(mod, &lowfp::quantize_cuda);
  lowfp::def_s2fp8(mod, &lowfp::s2fp8_cuda);
  lowfp::def_extra_bits(mod, &lowfp::extra_bits_split_cuda, &lowfp::extra_bits_merge_cuda,
                        &lowfp::extra_bits_step_cuda);
}
