// bfloat16 matrix products on the oneDNN that PyTorch is built with, through ATen, for the FFI kernel in
// onednn_matmul.cc.
//
// The kernel itself links the onednn-cpu-gomp wheel's oneDNN 3.2. PyTorch 2.13 carries oneDNN 3.12, whose AMX
// kernels are faster on large products: on a 2-core AMX Xeon a [2048,576] @ [576,1536] bf16 product took 1.17 ms
// here against 1.68 ms in 3.2 (`benchmarks/bench_cpu_matmul.py --aten-rows 2048`). PyTorch exports no oneDNN symbols,
// so this library reaches it through ATen's mm_out/bmm_out, which hand bf16 products to oneDNN where the CPU has bf16
// instructions or AVX-512. It is a library of its own so that only a process that runs such products loads
// libtorch_cpu, a large library: onednn.py loads it when it first stages a bf16 product of at least ATEN_MIN_MACS
// multiply-adds and passes `feynrl_aten_matmul` to the kernel (`feynrl_onednn_set_aten`), which hands it the bf16
// products with a bf16 result from that size on.
//
//   out[batch?][m, n] = op(a) @ op(b), all bf16, row-major, op(x) a transpose read through strides.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

namespace {
std::atomic<int64_t> calls{0};
}  // namespace

#ifndef FEYNRL_ONEDNN_SOURCE_HASH
#define FEYNRL_ONEDNN_SOURCE_HASH "unknown"
#endif
#ifndef FEYNRL_TORCH_VERSION
#define FEYNRL_TORCH_VERSION "unknown"
#endif
// The sources this library was compiled from (onednn.py's `source_hash`, the same as the kernel's) and the PyTorch
// version whose headers it was compiled against: a library built for another libtorch is not loaded.
extern "C" const char* feynrl_aten_source_hash() { return FEYNRL_ONEDNN_SOURCE_HASH; }
extern "C" const char* feynrl_aten_torch_version() { return FEYNRL_TORCH_VERSION; }

// How many products ran here (tests check the kernel hands them over).
extern "C" int64_t feynrl_aten_calls() { return calls.load(std::memory_order_relaxed); }

// ATen's intra-op threads: every thread that runs a product here sets its OpenMP team to `threads` (ATen otherwise
// sizes it from MKL's default, which need not be the cores this process may use). onednn.py passes its own count.
extern "C" void feynrl_aten_set_threads(int threads) { at::set_num_threads(threads); }

extern "C" int feynrl_aten_matmul(void* a, void* b, void* out, int64_t batch, int64_t m, int64_t k, int64_t n,
                                  int trans_a, int trans_b, char* error, int64_t error_size) {
  try {
    c10::InferenceMode no_autograd;
    std::vector<int64_t> a_sizes{m, k}, b_sizes{k, n}, out_sizes{m, n};
    std::vector<int64_t> a_strides = trans_a ? std::vector<int64_t>{1, m} : std::vector<int64_t>{k, 1};
    std::vector<int64_t> b_strides = trans_b ? std::vector<int64_t>{1, k} : std::vector<int64_t>{n, 1};
    std::vector<int64_t> out_strides{n, 1};
    if (batch > 0) {  // [batch, rows, cols], the matrices one after the other
      a_sizes.insert(a_sizes.begin(), batch);
      b_sizes.insert(b_sizes.begin(), batch);
      out_sizes.insert(out_sizes.begin(), batch);
      a_strides.insert(a_strides.begin(), m * k);
      b_strides.insert(b_strides.begin(), k * n);
      out_strides.insert(out_strides.begin(), m * n);
    }
    auto options = at::TensorOptions().dtype(at::kBFloat16);
    at::Tensor a_t = at::from_blob(a, a_sizes, a_strides, options);
    at::Tensor b_t = at::from_blob(b, b_sizes, b_strides, options);
    at::Tensor out_t = at::from_blob(out, out_sizes, out_strides, options);
    if (batch > 0) {
      at::bmm_out(out_t, a_t, b_t);
    } else {
      at::mm_out(out_t, a_t, b_t);
    }
    if (out_t.data_ptr() != out) {  // ATen resized or moved the result: the caller's buffer was not written
      std::snprintf(error, error_size, "ATen did not write the result in place");
      return 1;
    }
  } catch (const std::exception& e) {  // nothing may cross into XLA
    std::snprintf(error, error_size, "%s", e.what());
    return 1;
  } catch (...) {
    std::snprintf(error, error_size, "an exception that is not a std::exception");
    return 1;
  }
  calls.fetch_add(1, std::memory_order_relaxed);
  return 0;
}
