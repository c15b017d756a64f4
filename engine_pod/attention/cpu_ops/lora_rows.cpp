// A LoRA adapter's update row by row, for CPU steps of few rows (decode
// steps mixing adapters): out[t] += (x[t] . A[s]^T) . Bt[s], with s the row's
// adapter slot (rows of slot -1, the base model, untouched).
//
// Why not two GEMMs: at a few dozen rows each oneDNN call costs 30-60 us
// whatever its size, a mixed step multiplies every row by every slot's
// factors (the other slots' columns masked), and a layer needs a dozen such
// calls; a decode step of 32 rows on the bench model then spends a third of
// its time in them. Here one call per projection reads only the row's own
// slot, in float, and rounds once into out: the shrink row by row, the expand
// by blocks of output columns over every row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bf16_bits.h"

namespace {

using tessera_cpu::bits_float;
using tessera_cpu::to_bf16_bits;

template <typename scalar_t>
inline float load_float(const scalar_t* p) {
  return static_cast<float>(*p);
}
template <>
inline float load_float(const c10::BFloat16* p) {
  return bits_float(static_cast<uint32_t>(p->x) << 16);
}
template <typename scalar_t>
inline void store_float(scalar_t* p, float v) {
  *p = static_cast<scalar_t>(v);
}
template <>
inline void store_float(c10::BFloat16* p, float v) {
  p->x = to_bf16_bits(v);
}

// Output columns one expand task covers: every slot's B over them (4 slots x rank 16 x 128 bf16,
// 16 KiB) stays in L1 while all the rows pass, so each B element comes from memory once a call;
// row by row, a row re-read its slot's whole B (tens of KiB a projection) from L2 or beyond.
constexpr int64_t kColumnBlock = 128;
// Input features one shrink pass covers, for the same reason.
constexpr int64_t kInputBlock = 256;

template <typename scalar_t>
void lora_rows_impl(const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& slots,
                    const std::vector<int64_t>& ranks, at::Tensor& out) {
  const int64_t rows = x.size(0), in = x.size(1), num_slots = a.size(0), max_rank = a.size(1), cols = bt.size(2);
  const int64_t x_stride = x.stride(0), out_stride = out.stride(0);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* ap = a.data_ptr<scalar_t>();
  const scalar_t* bp = bt.data_ptr<scalar_t>();
  const int32_t* sp = slots.data_ptr<int32_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  auto rank_of = [&](int64_t t) -> int64_t {
    const int64_t s = sp[t];
    return s < 0 || s >= num_slots ? 0 : ranks[s];
  };
  // 1. Shrink, a block of input features at a time over every row of a task's rows: every slot's
  //    A over the block (4 slots x rank 16 x 256 bf16, 32 KiB) stays in L1 while the rows pass.
  std::vector<float> shrunk(rows * max_rank, 0.f);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k0 = 0; k0 < in; k0 += kInputBlock) {
      const int64_t width = std::min(kInputBlock, in - k0);
      float x_block[kInputBlock];
      for (int64_t t = begin; t < end; ++t) {
        const int64_t rank = rank_of(t);
        if (rank == 0) continue;
        for (int64_t k = 0; k < width; ++k) x_block[k] = load_float(xp + t * x_stride + k0 + k);
        for (int64_t r = 0; r < rank; ++r) {
          const scalar_t* a_row = ap + (sp[t] * max_rank + r) * in + k0;
          float acc = 0.f;
          for (int64_t k = 0; k < width; ++k) acc += x_block[k] * load_float(a_row + k);
          shrunk[t * max_rank + r] += acc;
        }
      }
    }
  });
  // 2. Expand, a block of output columns per task, every row in it.
  const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    float acc[kColumnBlock];
    for (int64_t block = begin; block < end; ++block) {
      const int64_t c0 = block * kColumnBlock, width = std::min(kColumnBlock, cols - c0);
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t rank = rank_of(t);
        if (rank == 0) continue;
        scalar_t* o = op + t * out_stride + c0;
        for (int64_t c = 0; c < width; ++c) acc[c] = load_float(o + c);
        for (int64_t r = 0; r < rank; ++r) {
          const scalar_t* b_row = bp + (sp[t] * max_rank + r) * cols + c0;
          const float v = shrunk[t * max_rank + r];
          for (int64_t c = 0; c < width; ++c) acc[c] += v * load_float(b_row + c);
        }
        for (int64_t c = 0; c < width; ++c) store_float(o + c, acc[c]);
      }
    }
  });
}

// x [T, in], a [slots, max_rank, in], bt [slots, max_rank, cols] (B times its
// scaling, transposed), slots [T] int32, ranks per slot; out [T, cols] with
// unit column stride (a column slice of a merged layer's output is fine).
void lora_rows(const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& slots,
               at::IntArrayRef ranks, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lora_rows: x must be [T, in] with unit column stride");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(2) == x.size(1), "lora_rows: a must be [slots, rank, in]");
  TORCH_CHECK(bt.dim() == 3 && bt.is_contiguous() && bt.size(0) == a.size(0) && bt.size(1) == a.size(1),
              "lora_rows: bt must be [slots, rank, cols] like a");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0) && out.size(1) == bt.size(2),
              "lora_rows: out must be [T, cols] with unit column stride");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kInt &&
                  slots.is_contiguous(), "lora_rows: slots must be [T] int32");
  TORCH_CHECK(static_cast<int64_t>(ranks.size()) == a.size(0), "lora_rows: one rank per slot");
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && x.scalar_type() == bt.scalar_type() &&
                  x.scalar_type() == out.scalar_type(), "lora_rows: x, a, bt and out must share a dtype");
  std::vector<int64_t> slot_ranks(ranks.begin(), ranks.end());
  for (int64_t r : slot_ranks) TORCH_CHECK(0 <= r && r <= a.size(1), "lora_rows: a rank is outside [0, max_rank]");
  if (x.scalar_type() == at::kFloat) {
    lora_rows_impl<float>(x, a, bt, slots, slot_ranks, out);
  } else if (x.scalar_type() == at::kBFloat16) {
    lora_rows_impl<c10::BFloat16>(x, a, bt, slots, slot_ranks, out);
  } else {
    TORCH_CHECK(false, "lora_rows: float32 or bfloat16 only");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tessera_cpu, m) {
  m.def("lora_rows(Tensor x, Tensor a, Tensor bt, Tensor slots, int[] ranks, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(tessera_cpu, CPU, m) {
  m.impl("lora_rows", &lora_rows);
}
