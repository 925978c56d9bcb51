// Runtime CPU feature detection. The build is portable (no -march=native); kernels compiled with
// -mavx2 -mfma -mf16c are only called when these report true.
#pragma once

namespace ktq {

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx_vnni = false;  // AVX-VNNI: vpdpbusd on 256-bit registers (VEX), no AVX-512 needed
};

// What the CPU (and OS) support, detected once.
const CpuFeatures& cpu_features();

// True when the AVX2+FMA+F16C kernels may run: the CPU has all three and neither the environment
// variable KTQUEST_FORCE_SCALAR=1 nor set_force_scalar(true) asks for the scalar twins.
bool use_avx2();

// Force the scalar kernels (tests run both paths). Process-wide.
void set_force_scalar(bool force);
bool force_scalar();

// True when use_avx2() and the CPU has AVX-VNNI, unless KTQUEST_NO_VNNI=1 or set_allow_vnni(false) keeps the
// AVX2 kernels (the kernels with a VNNI variant give the same bits either way; tests compare the three paths).
bool use_avx_vnni();
void set_allow_vnni(bool allow);
bool allow_vnni();

}  // namespace ktq
