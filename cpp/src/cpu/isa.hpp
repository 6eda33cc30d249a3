// Included first by every file compiled once per instruction-set level (CMakeLists.txt:
// LOWFP_ISAS), whose code lives in namespace lowfp::LOWFP_ISA_NS: the kernels' declarations, and
// the x86 intrinsics where the level has them.
#pragma once

#ifndef LOWFP_ISA_NS
#error "compile with -DLOWFP_ISA_NS=<namespace>"
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kernels.hpp"
