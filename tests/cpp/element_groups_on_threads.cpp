// The element-wise CUDA kernels' loop over groups of four elements (cpp/src/cuda/element_groups.hpp:
// quantize, S2FP8's elements, a scaled call's single block) followed on the CPU thread by thread,
// for 32-, 16- and 64-bit elements, mixed input and output widths, lengths that end inside a group,
// grids of one thread to more threads than groups, vector access or not, and in place. Checked
// against each element on its own: every group visited exactly once; y[i] = element(x[i], word i)
// for i < n, with word i of Philox block offset + i / 4 (stochastic) or 0 (nearest); nothing
// written past n; the events of elements below n counted, and no others. The element function is
// a mix of the element's bits and its word, so that a wrong element, word or group shows. Built
// and run by tests/test_api.py; prints one line per failure and exits 1 if any.
#include <cstdio>
#include <vector>

#include "element_groups.hpp"

namespace {

using namespace lowfp;

int failures = 0, cases = 0;

template <class In, class Out>
Out mixed(In v, uint32_t word) {
  return Out(uint64_t(v) * 0x9E3779B97F4A7C15ull ^ (uint64_t(word) << 3) ^ uint64_t(word));
}

// The element's events, from its bits: each of the three shows in some elements and not others.
template <class In>
RoundEvents events_of(In v) {
  RoundEvents ev;
  ev.above_max = v % 3 == 0;
  ev.underflow = v % 5 == 1;
  ev.nan = v % 7 == 2;
  return ev;
}

void fail(const char* what, int64_t n, int64_t threads, bool quad_io, bool in_place, int64_t at) {
  if (++failures <= 20)
    std::printf("%s: n=%lld threads=%lld quad_io=%d in_place=%d at %lld\n", what, (long long)n, (long long)threads,
                int(quad_io), int(in_place), (long long)at);
}

template <class In, class Out, RoundKind K>
void check(int64_t n, int64_t threads, bool quad_io, bool in_place) {
  ++cases;
  constexpr uint64_t kSeed = 0x243F6A8885A308D3ull, kOffset = 0xFFFFFFFFFFFFFFF0ull;  // (offsets wrap)
  constexpr Out kUntouched = Out(0x5A5A5A5A5A5A5A5Aull);
  const int64_t groups = (n + 3) / 4;
  // Every group visited once, by its thread.
  std::vector<int> visits(groups + 1, 0);
  std::vector<In> xs(n + 8);
  for (int64_t i = 0; i < n + 8; ++i) xs[i] = In(uint64_t(i) * 2654435761u + 12345u);
  std::vector<Out> ys(n + 8, kUntouched);
  for (int64_t t = 0; t < threads; ++t)
    transform_thread_groups(xs.data(), ys.data(), n, quad_io, t, threads, [&](int64_t g, const Quad<In>&) {
      if (g < 0 || g >= groups || g % threads != t) fail("group taken by the wrong thread", n, threads, quad_io, in_place, g);
      else ++visits[g];
      return Quad<Out>{};
    });
  for (int64_t g = 0; g < groups; ++g)
    if (visits[g] != 1) fail("group not visited once", n, threads, quad_io, in_place, g);

  // The rounding: values, words and counts.
  std::vector<In> x(xs);
  std::vector<Out> y(n + 8, kUntouched);
  In* x_at = x.data();
  Out* y_at = y.data();
  if constexpr (std::is_same_v<In, Out>)
    if (in_place) y_at = x_at;
  ThreadCounts total;
  for (int64_t t = 0; t < threads; ++t) {
    ThreadCounts tc;
    round_thread_groups<K, true>(x_at, y_at, n, quad_io, kSeed, kOffset, t, threads, tc,
                                 [&](In v, uint32_t word, RoundEvents& ev) {
                                   ev = events_of(v);
                                   return mixed<In, Out>(v, word);
                                 });
    total.overflow += tc.overflow;
    total.underflow += tc.underflow;
    total.nan += tc.nan;
  }
  ThreadCounts want_counts;
  for (int64_t i = 0; i < n + 8; ++i) {
    const uint32_t word = K == RoundKind::Stochastic ? philox_block(kSeed, kOffset + uint64_t(i / 4)).w[i % 4] : 0u;
    const Out want = i < n ? mixed<In, Out>(xs[i], word) : (in_place ? Out(xs[i]) : kUntouched);
    if (y_at[i] != want) fail(i < n ? "wrong element" : "written past n", n, threads, quad_io, in_place, i);
    if (i < n) want_counts.add(events_of(xs[i]));
  }
  if (total.overflow != want_counts.overflow || total.underflow != want_counts.underflow ||
      total.nan != want_counts.nan)
    fail("wrong counts", n, threads, quad_io, in_place, -1);
}

template <class In, class Out>
void check_all() {
  for (int64_t n : {0, 1, 3, 4, 5, 7, 8, 9, 63, 64, 65, 1000, 1001, 1027, 4099})
    for (int64_t threads : {1, 2, 3, 32, 100, 263, 2000})
      for (bool quad_io : {false, true})
        for (bool in_place : {false, true}) {
          if (in_place && !std::is_same_v<In, Out>) continue;
          check<In, Out, RoundKind::Nearest>(n, threads, quad_io, in_place);
          check<In, Out, RoundKind::Stochastic>(n, threads, quad_io, in_place);
        }
}

}  // namespace

int main() {
  check_all<uint32_t, uint32_t>();  // float32
  check_all<uint16_t, uint16_t>();  // bfloat16, float16: two groups in flight
  check_all<uint64_t, uint64_t>();  // float64
  check_all<uint32_t, uint16_t>();  // float32 to bfloat16
  check_all<uint16_t, uint32_t>();  // 16-bit to float32
  std::printf("%d failures in %d cases\n", failures, cases);
  return failures != 0;
}
