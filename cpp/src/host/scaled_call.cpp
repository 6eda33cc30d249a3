#include "scaled_call.hpp"

#include <cmath>
#include <stdexcept>
#include <string>

namespace lowfp {

ScaledCall prepare_scaled_call(const ScaledRequest& r) {
  auto in_range = [](int32_t v, int32_t lo, int32_t hi) { return v >= lo && v <= hi; };
  if (!in_range(int32_t(r.element.specials), 0, kSpecialsCodes - 1) ||
      !in_range(int32_t(r.scale_format.specials), 0, kSpecialsCodes - 1))
    throw std::invalid_argument("bad specials code");
  if (!in_range(int32_t(r.overflow), 0, 2)) throw std::invalid_argument("bad overflow code");
  if (!in_range(int32_t(r.mode), 0, 5)) throw std::invalid_argument("bad rounding code");
  if (!in_range(int32_t(r.dtype), 0, 3)) throw std::invalid_argument("bad dtype code");
  if (!in_range(int32_t(r.rule), 0, 4)) throw std::invalid_argument("bad scale rule code");
  if (!in_range(r.sr_bits, 1, 32))
    throw std::invalid_argument("sr_bits must be between 1 and 32, got " + std::to_string(r.sr_bits));
  for (const FormatSpec* f : {&r.element, &r.scale_format}) {
    if (f == &r.scale_format && r.rule != ScaleRule::Format) continue;
    const std::string bad = spec_error(*f);
    if (!bad.empty()) throw std::invalid_argument(bad);
    const std::string wide = fit_error(*f, DType::Float32);
    if (!wide.empty()) throw std::invalid_argument(wide);
  }
  if (r.element.m > kScaledMaxElementMantissa)
    throw std::invalid_argument("scaled formats take elements of at most " +
                                std::to_string(kScaledMaxElementMantissa) + " mantissa bits");
  ScaledCall c{};
  c.dtype = r.dtype;
  c.scale.rule = r.rule;
  c.scale.emax_e = max_exponent(r.element);
  c.scale.max_e = max_value(r.element);
  c.scale.m_e = r.element.m;
  if (r.rule == ScaleRule::Format) {
    c.scale.s = make_round_params<uint64_t>(r.scale_format, Overflow::Saturate, Rounding::Nearest, 32);
    c.scale.s_smallest = std::ldexp(1.0, smallest_exponent(r.scale_format));
    c.scale.s_max = max_value(r.scale_format);
    c.scale.t_s_max = r.choice == BlockChoice::Fixed ? c.scale.s_max : kFourOverSixTensorMax;
    c.scale.s_cap = max_exponent(r.scale_format) + 1;
    c.scale.by_addition = nearest_by_addition(c.scale.s, c.scale.s_cap);
    // a: the input's bits; max_E · t: E's significand bits, and t's 24
    c.scale.divide_once = nearest_divides_once(r.scale_format.m, r.element.m + 1 + 24, r.dtype);
  }
  c.narrow = r.rule != ScaleRule::Format && r.dtype != DType::Float64 && smallest_exponent(r.element) >= -22;
  if (r.dtype != DType::Float64) c.p32 = make_round_params<uint32_t>(r.element, r.overflow, r.mode, r.sr_bits);
  c.steps32 = c.narrow && r.mode == Rounding::Stochastic && stochastic_by_steps(c.p32);
  if (r.dtype == DType::Float16 || r.dtype == DType::BFloat16)
    c.out32 = make_round_params<uint32_t>(storage_spec(r.dtype), Overflow::Inf, Rounding::Nearest, 32);
  if (!in_range(int32_t(r.choice), 0, 2)) throw std::invalid_argument("bad block choice code");
  c.scale.choice = r.choice;
  if (r.choice != BlockChoice::Fixed) {
    // (the candidates' targets 6 and 4, and 4's scale within S's range: 1.5 · 256 <= max_S)
    if (r.rule != ScaleRule::Format || !r.tensor_scale || max_value(r.element) != 6.0 ||
        r.element.m != 1 || max_value(r.scale_format) < 1.5 * kFourOverSixTensorMax)
      throw std::invalid_argument(
          "4over6 takes FP4 E2M1 elements with scales in a format of at least 384 (E4M3) and a "
          "tensor scale");
  }
  c.tensor_scale = r.tensor_scale;
  if (r.tensor_scale && r.rule != ScaleRule::Format)
    throw std::invalid_argument("a tensor scale goes with block scales in a format");
  c.p = make_round_params<uint64_t>(r.element, r.overflow, r.mode, r.sr_bits);
  const bool nearest = r.mode == Rounding::Nearest;
  c.addition_cap = max_exponent(r.element) + 1;
  c.add32 = nearest && r.dtype != DType::Float64 && nearest_by_addition(c.p32, c.addition_cap);
  {
    const FormatSpec& e = r.element;
    const FormatSpec& sf = r.scale_format;
    const bool exact_product =  // q · S: at most 24 significand bits, within float32's normal range
        !r.tensor_scale || (e.m + sf.m + 2 <= 24 && smallest_exponent(e) + smallest_exponent(sf) >= -126 &&
                            max_exponent(e) + max_exponent(sf) + 2 <= 127);
    const bool checkable = r.rule == ScaleRule::Format && r.dtype == DType::Float32 &&
                           smallest_exponent(e) >= -22 && e.m <= 18 && exact_product;
    // (stochastic: a margin of 2^(m + 13) in 2^32, so that few elements are rounded twice)
    const bool stochastic_checked = r.mode == Rounding::Stochastic && e.m <= kCheckedStochasticMaxM &&
                                    stochastic_by_steps(c.p32);
    c.checked = checkable && (c.add32 || stochastic_checked);
    c.checked_margin = uint32_t(1) << (e.m + 13);
  }
  c.add64 = nearest && nearest_by_addition(c.p, c.addition_cap);
  c.steps64 = r.mode == Rounding::Stochastic && stochastic_by_steps(c.p);
  // s = S · t: S's significand bits, and the float32 tensor scale's 24
  const int32_t scale_bits = r.scale_format.m + 1 + (r.tensor_scale ? 24 : 0);
  c.divide_once = nearest && r.rule == ScaleRule::Format && nearest_divides_once(r.element.m, scale_bits, r.dtype);
  if (r.dtype == DType::Float16 || r.dtype == DType::BFloat16)
    c.out = make_round_params<uint64_t>(storage_spec(r.dtype), Overflow::Inf, Rounding::Nearest, 32);
  c.t = 1.0;
  c.mode = r.mode;
  return c;
}

ScaledCall with_buffers(ScaledCall c, const void* x, void* y, int64_t rows, int64_t cols,
                        int64_t block_rows, int64_t block_cols, int64_t word_run, uint64_t seed,
                        uint64_t offset, double* scales, float* q, int32_t counts_size) {
  if (rows < 0 || cols < 0 || block_rows < 1 || block_cols < 1)
    throw std::invalid_argument("bad shape or block");
  // (a block within one run of word_run rows: the GPU's column kernel steps each block's words)
  if (word_run < 0 || word_run % 4 != 0 ||
      (word_run > 0 && (rows % word_run != 0 || (rows != word_run && word_run % block_rows != 0))))
    throw std::invalid_argument("word_run must be 0 or a multiple of 4 that divides rows and, "
                                "unless it is rows, is a multiple of block_rows");
  if (counts_size != 0 && counts_size != 4 && counts_size != 6)
    throw std::invalid_argument("a scaled rounding's counts buffer holds 4 or 6 counts");
  if (scales == nullptr) throw std::invalid_argument("scaled_quantize needs a scales buffer");
  c.x = x;
  c.y = y;
  c.rows = rows;
  c.cols = cols;
  c.block_rows = block_rows;
  c.block_cols = block_cols;
  c.word_run = word_run;
  c.seed = seed;
  c.offset = offset;
  c.scales = scales;
  c.q = q;
  c.count = counts_size != 0;
  c.count_blocks = counts_size == 6;
  return c;
}

}  // namespace lowfp
