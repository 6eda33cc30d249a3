#include "accumulate_call.hpp"

#include <stdexcept>
#include <string>

namespace lowfp {

namespace {

void check_format(const FormatSpec& f, const char* what) {
  if (int32_t(f.specials) < 0 || int32_t(f.specials) >= kSpecialsCodes)
    throw std::invalid_argument("bad specials code");
  std::string bad = spec_error(f);
  if (bad.empty()) bad = fit_error(f, DType::Float32);
  if (!bad.empty()) throw std::invalid_argument(std::string(what) + ": " + bad);
}

}  // namespace

AccumulateParams prepare_accumulate(const AccumulateRequest& r) {
  for (Overflow o : {r.overflow, r.product_overflow, r.outer_overflow})
    if (int32_t(o) < 0 || int32_t(o) > 2) throw std::invalid_argument("bad overflow code");
  if (int32_t(r.mode) < 0 || int32_t(r.mode) > 5) throw std::invalid_argument("bad rounding code");
  if (int32_t(r.order) < 0 || int32_t(r.order) > 2) throw std::invalid_argument("bad order code");
  check_format(r.accumulator, "accumulator");
  if (r.accumulator.m > kAccumulateMaxMantissa)
    throw std::invalid_argument("an accumulator format has at most " +
                                std::to_string(kAccumulateMaxMantissa) + " mantissa bits");
  if (r.sr_bits < 1 || r.sr_bits > 32)
    throw std::invalid_argument("sr_bits must be between 1 and 32, got " + std::to_string(r.sr_bits));
  if (r.order == AccumulateOrder::Blocked && r.block < 1)
    throw std::invalid_argument("a blocked order needs a block of at least 1 product");
  if (r.order == AccumulateOrder::Pairwise && r.compensated)
    throw std::invalid_argument("compensated accumulation is sequential (or blocked), not pairwise");
  if (r.group < 0 || r.group > kAccumulateMaxGroup)
    throw std::invalid_argument("group must be between 1 and " + std::to_string(kAccumulateMaxGroup) +
                                " products (0: none)");
  if (r.group > 0) {
    if (r.align_bits < 1 || r.align_bits > kAccumulateMaxAlignBits)
      throw std::invalid_argument("align_bits must be between 1 and " +
                                  std::to_string(kAccumulateMaxAlignBits));
    if (r.operand_emin < -126 || r.operand_emin > 0)
      throw std::invalid_argument("operand_emin must be between -126 and 0");
    if (r.order == AccumulateOrder::Pairwise || r.compensated || r.has_product)
      throw std::invalid_argument("fused groups sum exact products, sequentially or in blocks, "
                                  "without compensation");
  }
  AccumulateParams p{};
  p.acc = make_round_params<uint64_t>(r.accumulator, r.overflow, r.mode, r.sr_bits);
  p.has_product = r.has_product;
  if (r.has_product) {
    check_format(r.product, "product");
    p.product = make_round_params<uint64_t>(r.product, r.product_overflow, Rounding::Nearest, 32);
    const int32_t cap = max_exponent(r.product) + 1;
    if (nearest_by_addition(p.product, cap)) p.product_add_cap = cap;
  }
  if (r.order == AccumulateOrder::Blocked) {
    check_format(r.outer, "outer");
    p.outer = make_round_params<uint64_t>(r.outer, r.outer_overflow, Rounding::Nearest, 32);
  }
  p.order = r.order;
  p.block = r.block;
  p.compensated = r.compensated;
  p.group = r.group;
  p.align_bits = r.align_bits;
  p.operand_emin = r.operand_emin;
  p.mode = r.mode;
  p.add_cap = max_exponent(r.accumulator) + 1;
  p.by_addition = r.mode == Rounding::Nearest && nearest_by_addition(p.acc, p.add_cap);
  quiet_fields(p);
  p.in_mode = in_mode_form(p);
  return p;
}

}  // namespace lowfp
