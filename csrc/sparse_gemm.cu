// Sparse-convolution products on CUTLASS 2.x tensor-core building blocks (sm_80 and later).
//
// One translation unit is one tile configuration of one element type, set by -D flags:
//   SC_ELEMENT  0 = half, 1 = bfloat16, 2 = float through tf32 tensor ops
//   SC_TB_M, SC_TB_N, SC_TB_K   threadblock tile;  SC_WARP_M, SC_WARP_N   warp tile
//   SC_STAGES   cp.async pipeline depth
// It defines eight extern "C" kernels, all with fp32 accumulation:
//   sc_rows_ab, sc_rows_abt   output-stationary over every kernel offset in one launch: a block
//                             owns BM output rows (visited in the order of a permutation that
//                             sorts rows by neighbour mask) and accumulates, offset after offset,
//                             A[table[k, row]] @ B_k in registers, skipping offsets that no row
//                             of its tile uses; one write per output row, no atomics.
//   sc_pairs_ab, sc_pairs_abt one kernel offset: D[scatter[p]] += A[gather[p]] @ B_k over the
//                             offset's pairs (fp32 D; the scatter rows of one offset are unique,
//                             launches of successive offsets are ordered by the stream).
//   sc_single_ab, sc_single_abt  maps where every output row has at most one pair (the transposed
//                             k2 s2 conv; the dgrad of the strided one): all offsets in one
//                             launch, a block per tile (offset k, first pair, pair count) of at
//                             most BM pairs, written straight in the output dtype (the rows of
//                             different blocks never meet).
//   sc_chunks_atb             dW chunks: for chunk c = (offset k, first pair, pair count),
//                             W_c = A[gather[pairs]]^T @ B[scatter[pairs]], gathered along the
//                             reduction dimension of both operands (split-K over the pairs);
//                             sc_chunks_sum then sums the chunks of each offset.
// "abt" reads B_k transposed through a column-major layout, so dgrad needs no copy of W.
// The launch geometry of every kernel is exported in sc_launch_info = {threads, shared bytes}.

#include <cutlass/cutlass.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>
#include <cutlass/gemm/gemm.h>
#include <cutlass/gemm/kernel/default_gemm_universal.h>
#include <cutlass/epilogue/thread/linear_combination.h>

#if SC_ELEMENT == 0
using Element = cutlass::half_t;
using InstructionShape = cutlass::gemm::GemmShape<16, 8, 16>;
#elif SC_ELEMENT == 1
using Element = cutlass::bfloat16_t;
using InstructionShape = cutlass::gemm::GemmShape<16, 8, 16>;
#elif SC_ELEMENT == 2
using Element = float;
using InstructionShape = cutlass::gemm::GemmShape<16, 8, 8>;
#else
#error "SC_ELEMENT must be 0 (half), 1 (bfloat16) or 2 (float, tf32)"
#endif

namespace sc {

using Accumulator = float;
using ThreadblockShape = cutlass::gemm::GemmShape<SC_TB_M, SC_TB_N, SC_TB_K>;
using WarpShape = cutlass::gemm::GemmShape<SC_WARP_M, SC_WARP_N, SC_TB_K>;
constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;

template <typename ElementOut>
using Epilogue = cutlass::epilogue::thread::LinearCombination<
    ElementOut, 128 / cutlass::sizeof_bits<ElementOut>::value, Accumulator, Accumulator>;

// The CUTLASS kernel whose threadblock-level Mma and Epilogue we drive ourselves.
template <typename LayoutA, typename LayoutB, typename ElementOut, bool GatherA, bool GatherB, bool ScatterD>
using Kernel = typename cutlass::gemm::kernel::DefaultGemmUniversal<
    Element, LayoutA, cutlass::ComplexTransform::kNone, kAlignment,
    Element, LayoutB, cutlass::ComplexTransform::kNone, kAlignment,
    ElementOut, cutlass::layout::RowMajor, Accumulator,
    cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
    ThreadblockShape, WarpShape, InstructionShape, Epilogue<ElementOut>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<>, SC_STAGES,
    cutlass::arch::OpMultiplyAdd, cutlass::gemm::SharedMemoryClearOption::kNone,
    GatherA, GatherB, ScatterD>::GemmKernel;

constexpr int kThreads = 32 * (SC_TB_M / SC_WARP_M) * (SC_TB_N / SC_WARP_N);

template <typename K>
constexpr int shared_bytes() {
  static_assert(K::kThreadCount == kThreads, "every kernel of a tile configuration has the same warps");
  return int(sizeof(typename K::SharedStorage));
}

// Forward/dgrad kernels: A (rows, reduce) row-major gathered by rows; D scattered by rows.
template <typename LayoutB, typename ElementOut>
using RowsKernel = Kernel<cutlass::layout::RowMajor, LayoutB, ElementOut, true, false, true>;
// wgrad: A viewed column-major (reduce = pairs is its strided dimension), both gathered along it.
using ChunksKernel = Kernel<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, Accumulator, true, true, false>;

template <typename K>
__device__ void accumulate(typename K::SharedStorage &shared, typename K::Mma::FragmentC &accumulators,
                           Element const *a, int lda, int const *gather_a, Element const *b, int ldb,
                           int const *gather_b, cutlass::gemm::GemmCoord problem, int m0, int n0) {
  using Mma = typename K::Mma;
  typename Mma::IteratorA::Params params_a{typename Mma::IteratorA::Layout(lda)};
  typename Mma::IteratorB::Params params_b{typename Mma::IteratorB::Layout(ldb)};
  int thread = threadIdx.x;
  typename Mma::IteratorA iterator_a(params_a, const_cast<Element *>(a), {problem.m(), problem.k()}, thread,
                                     {m0, 0}, gather_a);
  typename Mma::IteratorB iterator_b(params_b, const_cast<Element *>(b), {problem.k(), problem.n()}, thread,
                                     {0, n0}, gather_b);
  // A fresh Mma per call: its shared-memory iterators start at stage 0 again.
  Mma mma(shared.main_loop, thread, cutlass::canonical_warp_idx_sync(), threadIdx.x % 32);
  int iterations = (problem.k() + Mma::Shape::kK - 1) / Mma::Shape::kK;
  mma(iterations, accumulators, iterator_a, iterator_b, accumulators);
  __syncthreads();
}

template <typename K, typename ElementOut>
__device__ void store(typename K::SharedStorage &shared, typename K::Mma::FragmentC const &accumulators,
                      ElementOut *d, int ldd, int const *scatter_d, float beta, int rows, int cols, int m0,
                      int n0) {
  using Epi = typename K::Epilogue;
  typename Epi::OutputTileIterator::Params params_d{cutlass::layout::RowMajor(ldd)};
  typename K::EpilogueOutputOp::Params op_params(1.0f, beta);
  typename K::EpilogueOutputOp output_op(op_params);
  int thread = threadIdx.x;
  typename Epi::OutputTileIterator iterator_c(params_d, d, {rows, cols}, thread, {m0, n0}, scatter_d);
  typename Epi::OutputTileIterator iterator_d(params_d, d, {rows, cols}, thread, {m0, n0}, scatter_d);
  Epi epilogue(shared.epilogue, thread, cutlass::canonical_warp_idx_sync(), threadIdx.x % 32);
  epilogue(output_op, iterator_d, accumulators, iterator_c);
}

// table: (num_offsets, rows) gather rows of A per output slot (A's last row is all zeros and
// stands for "no neighbour"); order: (rows,) output row of each slot; active: (tiles,
// num_offsets) nonzero where some slot of the tile has a neighbour through that offset.
template <typename LayoutB>
__device__ void rows_gemm(Element const *a, Element const *w, int const *table, int const *order,
                          unsigned char const *active, Element *d, int rows, int reduce, int cols,
                          int num_offsets, long long w_offset_stride, int ldb) {
  using K = RowsKernel<LayoutB, Element>;
  extern __shared__ __align__(16) unsigned char smem[];
  auto &shared = *reinterpret_cast<typename K::SharedStorage *>(smem);
  int tile = blockIdx.x;
  int m0 = tile * ThreadblockShape::kM, n0 = blockIdx.y * ThreadblockShape::kN;
  typename K::Mma::FragmentC accumulators;
  accumulators.clear();
  cutlass::gemm::GemmCoord problem(rows, cols, reduce);
  for (int k = 0; k < num_offsets; ++k) {
    if (active[(long long)tile * num_offsets + k]) {
      accumulate<K>(shared, accumulators, a, reduce, table + (long long)k * rows, w + k * w_offset_stride, ldb,
                    nullptr, problem, m0, n0);
    }
  }
  store<K, Element>(shared, accumulators, d, cols, order, 0.0f, rows, cols, m0, n0);
}

template <typename LayoutB>
__device__ void pairs_gemm(Element const *a, Element const *w, int const *gather, int const *scatter,
                           Accumulator *d, int pairs, int reduce, int cols, int ldb) {
  using K = RowsKernel<LayoutB, Accumulator>;
  extern __shared__ __align__(16) unsigned char smem[];
  auto &shared = *reinterpret_cast<typename K::SharedStorage *>(smem);
  int m0 = blockIdx.x * ThreadblockShape::kM, n0 = blockIdx.y * ThreadblockShape::kN;
  typename K::Mma::FragmentC accumulators;
  accumulators.clear();
  accumulate<K>(shared, accumulators, a, reduce, gather, w, ldb, nullptr, {pairs, cols, reduce}, m0, n0);
  store<K, Accumulator>(shared, accumulators, d, cols, scatter, 1.0f, pairs, cols, m0, n0);
}

// tiles: (blocks, 3) = (offset k, first pair, pair count <= BM) of each block.
template <typename LayoutB>
__device__ void single_gemm(Element const *a, Element const *w, int const *gather, int const *scatter,
                            int const *tiles, Element *d, int reduce, int cols, int ldb) {
  using K = RowsKernel<LayoutB, Element>;
  extern __shared__ __align__(16) unsigned char smem[];
  auto &shared = *reinterpret_cast<typename K::SharedStorage *>(smem);
  int const *tile = tiles + 3 * blockIdx.x;
  int k = tile[0], first = tile[1], count = tile[2];
  int n0 = blockIdx.y * ThreadblockShape::kN;
  typename K::Mma::FragmentC accumulators;
  accumulators.clear();
  accumulate<K>(shared, accumulators, a, reduce, gather + first, w + (long long)k * reduce * cols, ldb, nullptr,
                {count, cols, reduce}, 0, n0);
  store<K, Element>(shared, accumulators, d, cols, scatter + first, 0.0f, count, cols, 0, n0);
}

}  // namespace sc

using RowMajorB = cutlass::layout::RowMajor;      // B_k = W_k (C_in, C_out), ld = C_out
using ColumnMajorB = cutlass::layout::ColumnMajor;  // B_k = W_k^T (C_out, C_in), ld = C_out

extern "C" __global__ void __launch_bounds__(sc::kThreads)
sc_rows_ab(Element const *a, Element const *w, int const *table, int const *order, unsigned char const *active,
           Element *d, int rows, int reduce, int cols, int num_offsets) {
  sc::rows_gemm<RowMajorB>(a, w, table, order, active, d, rows, reduce, cols, num_offsets,
                           (long long)reduce * cols, cols);
}

extern "C" __global__ void __launch_bounds__(sc::kThreads)
sc_rows_abt(Element const *a, Element const *w, int const *table, int const *order, unsigned char const *active,
            Element *d, int rows, int reduce, int cols, int num_offsets) {
  sc::rows_gemm<ColumnMajorB>(a, w, table, order, active, d, rows, reduce, cols, num_offsets,
                              (long long)reduce * cols, reduce);
}

extern "C" __global__ void __launch_bounds__(sc::kThreads)
sc_pairs_ab(Element const *a, Element const *w_k, int const *gather, int const *scatter, float *d, int pairs,
            int reduce, int cols) {
  sc::pairs_gemm<RowMajorB>(a, w_k, gather, scatter, d, pairs, reduce, cols, cols);
}

extern "C" __global__ void __launch_bounds__(sc::kThreads)
sc_pairs_abt(Element const *a, Element const *w_k, int const *gather, int const *scatter, float *d, int pairs,
             int reduce, int cols) {
  sc::pairs_gemm<ColumnMajorB>(a, w_k, gather, scatter, d, pairs, reduce, cols, reduce);
}

extern "C" __global__ void __launch_bounds__(sc::kThreads)
sc_single_ab(Element const *a, Element const *w, int const *gather, int const *scatter, int const *tiles, Element *d,
             int reduce, int cols) {
  sc::single_gemm<RowMajorB>(a, w, gather, scatter, tiles, d, reduce, cols, cols);
}

extern "C" __global__ void __launch_bounds__(sc::kThreads)
sc_single_abt(Element const *a, Element const *w, int const *gather, int const *scatter, int const *tiles, Element *d,
              int reduce, int cols) {
  sc::single_gemm<ColumnMajorB>(a, w, gather, scatter, tiles, d, reduce, cols, reduce);
}

// chunks: (num_chunks, 2) = (first pair, pair count); out: (num_chunks, rows_a, cols_b) fp32.
extern "C" __global__ void __launch_bounds__(sc::kThreads)
sc_chunks_atb(Element const *a, Element const *b, int const *gather_a, int const *gather_b, int const *chunks,
              float *out, int channels_a, int channels_b) {
  using K = sc::ChunksKernel;
  extern __shared__ __align__(16) unsigned char smem[];
  auto &shared = *reinterpret_cast<K::SharedStorage *>(smem);
  int chunk = blockIdx.z;
  int first = chunks[2 * chunk], count = chunks[2 * chunk + 1];
  int m0 = blockIdx.x * sc::ThreadblockShape::kM, n0 = blockIdx.y * sc::ThreadblockShape::kN;
  K::Mma::FragmentC accumulators;
  accumulators.clear();
  sc::accumulate<K>(shared, accumulators, a, channels_a, gather_a + first, b, channels_b, gather_b + first,
                    {channels_a, channels_b, count}, m0, n0);
  sc::store<K, float>(shared, accumulators, out + (long long)chunk * channels_a * channels_b, channels_b, nullptr,
                      0.0f, channels_a, channels_b, m0, n0);
}

// dw[k] = the sum of chunks [starts[k], starts[k + 1]) of partial, in the element type: the split-K
// parts of sc_chunks_atb met in a fixed order (deterministic, unlike atomics), in one pass.
// partial: (num_chunks, size) fp32; starts: (num_offsets + 1); dw: (num_offsets, size); size % 4 == 0
// (channel counts are multiples of 4). Grid: (ceil(size / (4 * threads)), num_offsets).
extern "C" __global__ void __launch_bounds__(sc::kThreads)
sc_chunks_sum(float const *partial, int const *starts, Element *dw, int size) {
  int k = blockIdx.y;
  long long i = 4 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= size) {
    return;
  }
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int c = starts[k]; c < starts[k + 1]; ++c) {
    float4 part = *reinterpret_cast<float4 const *>(partial + (long long)c * size + i);
    sum.x += part.x;
    sum.y += part.y;
    sum.z += part.z;
    sum.w += part.w;
  }
  cutlass::AlignedArray<Element, 4> out;
  out[0] = Element(sum.x);
  out[1] = Element(sum.y);
  out[2] = Element(sum.z);
  out[3] = Element(sum.w);
  *reinterpret_cast<cutlass::AlignedArray<Element, 4> *>(dw + (long long)k * size + i) = out;
}

// {threads per block, dynamic shared bytes} of sc_rows_ab, sc_rows_abt, sc_pairs_ab, sc_pairs_abt, sc_chunks_atb,
// sc_single_ab, sc_single_abt, sc_chunks_sum.
extern "C" __device__ int sc_launch_info[8][2] = {
    {sc::kThreads, sc::shared_bytes<sc::RowsKernel<RowMajorB, Element>>()},
    {sc::kThreads, sc::shared_bytes<sc::RowsKernel<ColumnMajorB, Element>>()},
    {sc::kThreads, sc::shared_bytes<sc::RowsKernel<RowMajorB, sc::Accumulator>>()},
    {sc::kThreads, sc::shared_bytes<sc::RowsKernel<ColumnMajorB, sc::Accumulator>>()},
    {sc::kThreads, sc::shared_bytes<sc::ChunksKernel>()},
    {sc::kThreads, sc::shared_bytes<sc::RowsKernel<RowMajorB, Element>>()},
    {sc::kThreads, sc::shared_bytes<sc::RowsKernel<ColumnMajorB, Element>>()},
    {sc::kThreads, 0},
};
