// A matrix product through oneDNN, 2-D or batched, called from XLA:CPU as a typed FFI custom call.
//
// XLA:CPU computes bfloat16 dots in float32 after widening the operands; oneDNN runs them on the CPU's bf16
// instructions (AVX-512-BF16 `vdpbf16ps`, or AMX tiles on CPUs that have them) with float32 accumulation.
//
//   out[M, N] = op(a) @ op(b),  op(a) = a [M, K] or a^T with a [K, M] (trans_a),
//                               op(b) = b [K, N] or b^T with b [N, K] (trans_b);
//   batched: operands and result all 3-D, [Bt, ...], one such product per index of the leading axis
//   (attention's per-head products).
//
// a and b share one element type (bf16 or f32); out is bf16 or f32. Transposes are read through strides, so the
// backward pass (dx = dy @ w^T, dw = x^T @ dy) needs no copies.
//
// Large bf16 products with a bf16 result go to PyTorch's oneDNN (aten_matmul.cc) once onednn.py has handed this
// library that function and the size from which it takes them (`feynrl_onednn_set_aten`); the rest, and all of them
// where PyTorch is not installed, run here.
//
// A second target, `feynrl_cache_write` (`CacheWrite`), writes a decode step's keys and values into a bfloat16 KV
// cache in place (onednn.cache_write). A third, `feynrl_onednn_cache_matmul` (`CacheMatmul`), multiplies by the first
// positions of a KV cache's keys or values where they lie, without copying that prefix out first (onednn.cache_dot).
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <string>
#include <tuple>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

bool dnnl_type(ffi::DataType type, dnnl::memory::data_type* out) {
  switch (type) {
    case ffi::DataType::BF16:
      *out = dnnl::memory::data_type::bf16;
      return true;
    case ffi::DataType::F32:
      *out = dnnl::memory::data_type::f32;
      return true;
    default:
      return false;
  }
}

// aten_matmul.cc's `feynrl_aten_matmul`, or null: bf16 products with a bf16 result run there when set.
using AtenMatmul = int (*)(void*, void*, void*, int64_t, int64_t, int64_t, int64_t, int, int, char*, int64_t);
std::atomic<AtenMatmul> aten_matmul{nullptr};
// The fewest multiply-adds (batch x m x k x n) of a product that goes to `aten_matmul`.
std::atomic<int64_t> aten_min_macs{0};

// One matmul primitive per shape, transpose and dtypes, created once per calling thread: creating a primitive
// descriptor costs tens of microseconds, as much as a decode step's small products themselves. Per thread, because
// a oneDNN primitive must not run on two threads at once (its scratchpad is its own; this build does not enable
// concurrent execution), and XLA runs independent products of one shape (gate and up, k and v) concurrently.
// The last two elements are b's batch and row strides where b is a prefix of longer blocks (`CacheMatmul`), 0 where b
// is dense.
using Key = std::tuple<int64_t, int64_t, int64_t, int64_t, bool, bool, int, int, int64_t, int64_t>;

dnnl::matmul cached_matmul(const Key& key, const dnnl::memory::desc& a_md, const dnnl::memory::desc& b_md,
                           const dnnl::memory::desc& out_md) {
  thread_local std::map<Key, dnnl::matmul> cache;
  auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  // Strict float math: float32 products stay float32 even where ONEDNN_DEFAULT_FPMATH_MODE allows bf16 or tf32.
  dnnl::primitive_attr attr;
  attr.set_fpmath_mode(dnnl::fpmath_mode::strict);
  dnnl::matmul matmul(dnnl::matmul::primitive_desc(cpu_engine(), a_md, b_md, out_md, attr));
  cache.emplace(key, matmul);
  return matmul;
}

// A [rows, cols] view of a row-major 2-D buffer: [rows, cols] itself, or [cols, rows] read transposed when `trans`;
// with `batch` > 0 a [batch, rows, cols] view of `batch` such matrices stored one after the other.
dnnl::memory::desc view(int64_t batch, int64_t rows, int64_t cols, dnnl::memory::data_type type, bool trans) {
  dnnl::memory::dims strides = trans ? dnnl::memory::dims{1, rows} : dnnl::memory::dims{cols, 1};
  if (batch == 0) return dnnl::memory::desc({rows, cols}, type, strides);
  return dnnl::memory::desc({batch, rows, cols}, type, {rows * cols, strides[0], strides[1]});
}

// Runs `out = a @ b` over the given views of the three buffers with the primitive cached for `key`; oneDNN's
// errors become the FFI error `name: ...`.
ffi::Error Execute(const char* name, const Key& key, const dnnl::memory::desc& a_md, const dnnl::memory::desc& b_md,
                   const dnnl::memory::desc& out_md, void* a, void* b, void* out) {
  try {
    dnnl::engine& engine = cpu_engine();
    dnnl::matmul matmul = cached_matmul(key, a_md, b_md, out_md);
    dnnl::memory a_mem(a_md, engine, a);
    dnnl::memory b_mem(b_md, engine, b);
    dnnl::memory out_mem(out_md, engine, out);
    thread_local dnnl::stream stream(engine);
    matmul.execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, out_mem}});
    stream.wait();
  } catch (const dnnl::error& e) {
    return ffi::Error::Internal(std::string(name) + ": " + e.what());
  } catch (const std::exception& e) {  // nothing may cross the FFI boundary
    return ffi::Error::Internal(std::string(name) + ": " + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error Matmul(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out, int64_t trans_a,
                  int64_t trans_b) {
  const size_t rank = a.dimensions().size();
  if ((rank != 2 && rank != 3) || b.dimensions().size() != rank || out->dimensions().size() != rank) {
    return ffi::Error::InvalidArgument("onednn_matmul: operands and result must be all 2-D or all 3-D");
  }
  // The matrix axes: the last two; a leading batch axis when 3-D (batch = 0 marks a 2-D product).
  const int64_t* a_dims = a.dimensions().begin() + rank - 2;
  const int64_t* b_dims = b.dimensions().begin() + rank - 2;
  const int64_t* out_dims = out->dimensions().begin() + rank - 2;
  const int64_t batch = rank == 3 ? a.dimensions()[0] : 0;
  if (rank == 3 && (b.dimensions()[0] != batch || out->dimensions()[0] != batch)) {
    return ffi::Error::InvalidArgument("onednn_matmul: batch sizes do not agree");
  }
  const int64_t m = trans_a ? a_dims[1] : a_dims[0];
  const int64_t k = trans_a ? a_dims[0] : a_dims[1];
  const int64_t k_b = trans_b ? b_dims[1] : b_dims[0];
  const int64_t n = trans_b ? b_dims[0] : b_dims[1];
  if (k != k_b || out_dims[0] != m || out_dims[1] != n) {
    return ffi::Error::InvalidArgument("onednn_matmul: shapes do not agree: [" + std::to_string(m) + ", " +
                                       std::to_string(k) + "] @ [" + std::to_string(k_b) + ", " + std::to_string(n) +
                                       "] -> [" + std::to_string(out_dims[0]) + ", " + std::to_string(out_dims[1]) +
                                       "]");
  }
  dnnl::memory::data_type in_type, out_type;
  if (a.element_type() != b.element_type() || !dnnl_type(a.element_type(), &in_type) ||
      !dnnl_type(out->element_type(), &out_type)) {
    return ffi::Error::InvalidArgument("onednn_matmul: operands must both be bf16 or f32, the result bf16 or f32");
  }
  if (m == 0 || n == 0 || (rank == 3 && batch == 0)) return ffi::Error::Success();
  if (k == 0) {  // an empty sum
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  AtenMatmul aten = aten_matmul.load(std::memory_order_acquire);
  const int64_t macs = (batch > 0 ? batch : 1) * m * k * n;
  if (aten != nullptr && in_type == dnnl::memory::data_type::bf16 && out_type == dnnl::memory::data_type::bf16 &&
      macs >= aten_min_macs.load(std::memory_order_acquire)) {
    char error[512] = "";
    if (aten(a.untyped_data(), b.untyped_data(), out->untyped_data(), batch, m, k, n, trans_a != 0, trans_b != 0,
             error, sizeof(error))) {
      return ffi::Error::Internal(std::string("onednn_matmul (ATen): ") + error);
    }
    return ffi::Error::Success();
  }
  Key key{batch, m, k, n, trans_a != 0, trans_b != 0, static_cast<int>(in_type), static_cast<int>(out_type), 0, 0};
  return Execute("onednn_matmul", key, view(batch, m, k, in_type, trans_a), view(batch, k, n, in_type, trans_b),
                 view(batch, m, n, out_type, false), a.untyped_data(), b.untyped_data(), out->untyped_data());
}


// `out [Bt, M, N] = a [Bt, M, Ka] @ b`, where b is the first positions of one layer's KV cache blocks, read where they
// lie: the keys' `cache [Bt, Dh, S]` (`keys_transposed`; Ka = Dh, b = cache[:, :, :N]) or the values' `cache [Bt, S,
// Dh]` (Ka <= S, N = Dh, b = cache[:, :Ka, :]). A decode step attends to the cache's first positions only (those its
// rows reached); XLA would copy them out for a product, about as long as the product itself.
ffi::Error CacheMatmul(ffi::AnyBuffer a, ffi::AnyBuffer cache, ffi::Result<ffi::AnyBuffer> out,
                       int64_t keys_transposed) {
  if (a.dimensions().size() != 3 || cache.dimensions().size() != 3 || out->dimensions().size() != 3) {
    return ffi::Error::InvalidArgument("onednn_cache_matmul: operands and result must be 3-D");
  }
  const int64_t batch = a.dimensions()[0], m = a.dimensions()[1], k = a.dimensions()[2];
  const int64_t rows = cache.dimensions()[1], cols = cache.dimensions()[2], n = out->dimensions()[2];
  // The product's b: [k, n] read with row stride `cols` from the cache block of [rows, cols].
  const bool fits = keys_transposed ? (k == rows && n <= cols) : (k <= rows && n == cols);
  if (cache.dimensions()[0] != batch || out->dimensions()[0] != batch || out->dimensions()[1] != m || !fits) {
    return ffi::Error::InvalidArgument("onednn_cache_matmul: shapes do not agree: [" + std::to_string(batch) + ", " +
                                       std::to_string(m) + ", " + std::to_string(k) + "] @ cache [" +
                                       std::to_string(cache.dimensions()[0]) + ", " + std::to_string(rows) + ", " +
                                       std::to_string(cols) + "] -> " + std::to_string(n) + " columns");
  }
  dnnl::memory::data_type in_type, out_type;
  if (a.element_type() != cache.element_type() || !dnnl_type(a.element_type(), &in_type) ||
      !dnnl_type(out->element_type(), &out_type)) {
    return ffi::Error::InvalidArgument(
        "onednn_cache_matmul: operands must both be bf16 or f32, the result bf16 or f32");
  }
  if (batch == 0 || m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::memset(out->untyped_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  const dnnl::memory::desc b_md({batch, k, n}, in_type, {rows * cols, cols, 1});
  Key key{batch, m, k, n, false, false, static_cast<int>(in_type), static_cast<int>(out_type), rows * cols, cols};
  return Execute("onednn_cache_matmul", key, view(batch, m, k, in_type, false), b_md,
                 view(batch, m, n, out_type, false), a.untyped_data(), cache.untyped_data(), out->untyped_data());
}

// The cache write's loop (`CacheWrite`), over elements of the cache's width.
struct WriteShape {
  int64_t batch, heads, head_dim, length, steps, layer;
  bool keys_transposed;
};

template <typename T>
void WriteRows(T* cache, const T* update, const int32_t* positions, const int32_t* rows, int64_t updates,
               const WriteShape& shape) {
  for (int64_t b = 0; b < updates; ++b) {
    const int64_t r = rows[b];
    if (r < 0 || r >= shape.batch) continue;
    for (int64_t t = 0; t < shape.steps; ++t) {
      const int64_t s = positions[b * shape.steps + t];
      if (s < 0 || s >= shape.length) continue;
      for (int64_t h = 0; h < shape.heads; ++h) {
        const T* row = update + ((b * shape.steps + t) * shape.heads + h) * shape.head_dim;
        // the [Dh, S] (keys) or [S, Dh] (values) block of cache row r, head h
        T* block = cache + ((shape.layer * shape.batch + r) * shape.heads + h) * shape.head_dim * shape.length;
        if (shape.keys_transposed) {
          for (int64_t d = 0; d < shape.head_dim; ++d) block[d * shape.length + s] = row[d];
        } else {
          std::memcpy(block + s * shape.head_dim, row, shape.head_dim * sizeof(T));
        }
      }
    }
  }
}

// Writes `update [R, T, K, Dh]` into rows `rows [R]` of a KV cache at per-row positions, in place: `cache [B, K, Dh,
// S]` (keys, stored transposed: `keys_transposed`) or `[B, K, S, Dh]` (values), `cache[rows[i], h, :, index[i, t]] =
// update[i, t, h, :]`; or into layer `layer` of a stacked cache `[L, B, K, ...]`. Positions outside [0, S) are
// dropped (a padding token's), and so are rows outside [0, B) and a layer outside [0, L). The result aliases the
// cache (`input_output_aliases`); where XLA gave it a buffer of its own, the cache is copied there first. Any 2- or
// 4-byte element type, its bits copied as they are: XLA:CPU widens a bfloat16 scatter's whole operand to float32 and
// narrows it back (the whole cache at every decode step), where this touches only the written positions.
ffi::Error CacheWrite(ffi::AnyBuffer cache, ffi::AnyBuffer update, ffi::Buffer<ffi::S32> index,
                      ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> out,
                      int64_t keys_transposed) {
  const size_t rank = cache.dimensions().size();
  if ((rank != 4 && rank != 5) || update.dimensions().size() != 4 || index.dimensions().size() != 2 ||
      rows.dimensions().size() != 1 || layer.dimensions().size() != 0) {
    return ffi::Error::InvalidArgument(
        "cache_write: cache must be 4-D or 5-D, update 4-D, index 2-D, rows 1-D, layer a scalar");
  }
  const int64_t* dims = cache.dimensions().begin() + rank - 4;  // [B, K, Dh, S] or [B, K, S, Dh]
  const int64_t layers = rank == 5 ? cache.dimensions()[0] : 1;
  const int64_t batch = dims[0], heads = dims[1];
  const int64_t head_dim = keys_transposed ? dims[2] : dims[3];
  const int64_t length = keys_transposed ? dims[3] : dims[2];
  const int64_t updates = update.dimensions()[0], steps = update.dimensions()[1];
  if (update.dimensions()[2] != heads || update.dimensions()[3] != head_dim || index.dimensions()[0] != updates ||
      index.dimensions()[1] != steps || rows.dimensions()[0] != updates) {
    return ffi::Error::InvalidArgument("cache_write: the shapes of cache, update and index do not agree");
  }
  const size_t size = ffi::ByteWidth(cache.element_type());
  if (update.element_type() != cache.element_type() || out->element_type() != cache.element_type() ||
      (size != 2 && size != 4) || out->size_bytes() != cache.size_bytes()) {
    return ffi::Error::InvalidArgument("cache_write: cache, update and result must share one 2- or 4-byte type");
  }
  if (out->untyped_data() != cache.untyped_data()) {
    std::memcpy(out->untyped_data(), cache.untyped_data(), cache.size_bytes());
  }
  const int64_t l = rank == 5 ? *layer.typed_data() : 0;
  if (l < 0 || l >= layers) return ffi::Error::Success();
  const WriteShape shape{batch, heads, head_dim, length, steps, l, keys_transposed != 0};
  if (size == 2) {
    WriteRows(static_cast<uint16_t*>(out->untyped_data()), static_cast<const uint16_t*>(update.untyped_data()),
              index.typed_data(), rows.typed_data(), updates, shape);
  } else {
    WriteRows(static_cast<uint32_t*>(out->untyped_data()), static_cast<const uint32_t*>(update.untyped_data()),
              index.typed_data(), rows.typed_data(), updates, shape);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FeynrlOnednnMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("trans_a")
                                  .Attr<int64_t>("trans_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FeynrlCacheMatmul, CacheMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("keys_transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FeynrlCacheWrite, CacheWrite,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("keys_transposed"));

// The source this library was compiled from (a hash `build` passes), so a library older than its source is refused.
#ifndef FEYNRL_ONEDNN_SOURCE_HASH
#define FEYNRL_ONEDNN_SOURCE_HASH "unknown"
#endif
extern "C" const char* feynrl_onednn_source_hash() { return FEYNRL_ONEDNN_SOURCE_HASH; }

// Hands this library aten_matmul.cc's `feynrl_aten_matmul` for bf16 products of at least `min_macs` multiply-adds
// (null: every product runs here again).
extern "C" void feynrl_onednn_set_aten(void* fn, int64_t min_macs) {
  if (fn == nullptr) {  // withdrawn first: a product running meanwhile never sees the function with another threshold
    aten_matmul.store(nullptr, std::memory_order_release);
    aten_min_macs.store(min_macs, std::memory_order_release);
    return;
  }
  aten_min_macs.store(min_macs, std::memory_order_release);
  aten_matmul.store(reinterpret_cast<AtenMatmul>(fn), std::memory_order_release);
}
