// Output-stationary sparse-conv products on Hopper tensor cores (sm_90a: wgmma, mbarriers,
// setmaxnreg), written with CuTe.
//
// One translation unit is one tile configuration of one element type, set by -D flags:
//   SC_ELEMENT    0 = half, 1 = bfloat16 (fp32 accumulation)
//   SC_TB_N       128 or 256: output columns per block (the N of one m64nNk16 wgmma)
//   SC_TB_K       64: channels per pipeline stage (one 128-byte swizzle atom of 16-bit elements)
//   SC_STAGES     depth of the shared-memory ring between the gathering warps and the wgmma warps
//   SC_CONSUMERS  1 or 2 wgmma warpgroups; the block owns BM = 64 * SC_CONSUMERS output slots
// It defines two extern "C" kernels, sc90_rows_ab and sc90_rows_abt, with the semantics of
// sc_rows_ab / sc_rows_abt in sparse_gemm.cu but a per-tile list of offsets instead of a mask:
//   for every slot s of [0, rows): d[order[s]] (+)= sum over the tile's listed offsets k of
//   A[table[k * rows + s]] @ B_k,
// where A is (sources, reduce) row-major and a table entry equal to `sources` means "no
// neighbour" (sparse_gemm.cu's zero row; never read here: the kernel writes zeros for it, so A
// needs no such row and whatever follows it is not touched), B_k = W_k (ab: W is (K, reduce, cols)) or W_k^T (abt: W is (K, cols, reduce), dgrad
// without a transposed copy), passed as W_packed from sc90_pack_ab / sc90_pack_abt of the same
// translation unit (B_k cut into the kernel's shared-memory tiles, see pack_b), tile t = BM
// consecutive slots visits active[t * list_len + j] for j < count[t], and tile i of the
// ceil(rows / BM) * ceil(cols / BN) output tiles is row tile i / tiles_n, column tile i % tiles_n,
// so the column tiles of one row tile are next to each other and meet the same gathered rows in
// L2. accumulate = 1 adds to d (read, add in fp32, write) instead of storing: a later group of
// offsets. Slots and columns past the problem are masked.
// Requirements: reduce % 8 == 0 and cols % 8 == 0 (every copy of A is 16 bytes and never
// straddles the end of a row; the packed W is zero-padded to whole tiles).
// Launch: persistent, any 1-D grid (one block an SM is the intent): block b takes tile b, then
// the next one nobody has taken, counted by the int *next, which must be 0 when the launch starts
// (sc90_pack_* zeroes the counters of the launches that follow it); 128 * (1 + SC_CONSUMERS)
// threads, sc90_launch_info[kernel] = {threads, dynamic shared bytes} for (ab, abt); the host must
// raise the kernel's dynamic shared-memory limit to it.
//
// Why this shape: the gather is the slow part (every A row is a different, random 128-byte line)
// and sm_90's tensor copies (TMA) take boxes, not lists of rows, so one warpgroup does nothing
// but gather: it issues 16-byte cp.async copies straight into the swizzled layouts wgmma reads,
// up to SC_STAGES steps ahead, and each of its threads signals a stage's "full" mbarrier with
// cp.async.mbarrier.arrive.noinc, which fires once that thread's copies have landed, so nobody
// waits on cp.async groups. B_k, already in shared-memory order, comes in one bulk copy a stage
// (cp.async.bulk, counted on the same barrier as bytes). The wgmma warpgroups never issue a
// load: they wait for a stage, multiply it from shared memory (SS operands, fp32 in registers),
// keep one wgmma batch in flight and hand the previous stage back through its "empty" mbarrier.
// One loop runs over (listed offset, channel block) pairs, so the pipeline never drains between
// offsets, and the ring runs on from tile to tile, so it does not drain between tiles either: the
// gathering warps fill the next tile's stages while the wgmma warps store this one (for
// accumulate they first prefetch the tile's old output rows into L2). The gathering warps keep
// 72 registers and give the rest to the wgmma warps (setmaxnreg), whose 64 x 256 fp32
// accumulators take 128 registers a thread.

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>
#include <cutlass/half.h>

#if SC_ELEMENT == 0
using Element = cutlass::half_t;
#elif SC_ELEMENT == 1
using Element = cutlass::bfloat16_t;
#else
#error "SC_ELEMENT must be 0 (half) or 1 (bfloat16)"
#endif

#if !(SC_TB_N == 128 || SC_TB_N == 256)
#error "SC_TB_N must be 128 or 256"
#endif
#if SC_TB_K != 64
#error "SC_TB_K must be 64 (one 128-byte swizzle atom of 16-bit elements)"
#endif
#if !(SC_CONSUMERS == 1 || SC_CONSUMERS == 2)
#error "SC_CONSUMERS must be 1 or 2"
#endif
#if SC_STAGES < 2
#error "SC_STAGES must be at least 2"
#endif
// SC_EPILOGUE_BATCH: chunks of 4 column groups whose old values (accumulate) load together (on
// street4's second offset group at C = 256: 1 took 0.764 ms, 2 0.717, 4 0.706).
#ifndef SC_EPILOGUE_BATCH
#define SC_EPILOGUE_BATCH 4
#endif
#if SC_TB_N % (32 * SC_EPILOGUE_BATCH) != 0
#error "SC_EPILOGUE_BATCH chunks of 32 columns must divide SC_TB_N"
#endif

namespace sc90 {

using namespace cute;

constexpr int kConsumers = SC_CONSUMERS;
constexpr int kStages = SC_STAGES;
constexpr int BM = 64 * kConsumers, BN = SC_TB_N, BK = SC_TB_K;
constexpr int kWarpgroup = 128;
constexpr int kThreads = kWarpgroup * (1 + kConsumers);
constexpr int kVector = 8;  // 16-bit elements per 16-byte copy
constexpr int kTileSlots = 2;  // tile numbers handed from the scheduling thread to the block
// Registers per thread after setmaxnreg, for two wgmma warpgroups: a block of 384 threads starts
// with 168 each (64K / 384, rounded down to 8) and 128 * producer + 256 * consumer may not exceed
// 384 * 168. 72 for the gathering warps leaves 216 for the wgmma warps; with 56 (the tile loop of
// the persistent blocks) ptxas spilled 144 bytes of the gathering loop, with 64 still 44, with 72
// 8. One wgmma warpgroup (256 threads) starts with enough registers for both roles and
// reconfigures nothing.
constexpr int kProducerRegisters = 72;
constexpr int kConsumerRegisters = (kThreads * 168 - kWarpgroup * kProducerRegisters) / (kWarpgroup * kConsumers) / 8 * 8;
static_assert(kConsumers == 1 || kConsumerRegisters == 216, "two wgmma warpgroups: 72 + 2 x 216 registers");

// A is K-major (channels contiguous) in both products; B is N-major for ab (a row of W_k holds
// the output columns) and K-major for abt (a row of W_k holds the reduced channels).
template <bool Transposed>
struct Operands {
  static constexpr GMMA::Major kMajorB = Transposed ? GMMA::Major::K : GMMA::Major::MN;
  using LayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                         make_shape(Int<BM>{}, Int<BK>{}, Int<kStages>{})));
  // An N-major atom is 64 columns x 8 channels: stack the atoms along K first, as CUTLASS's own
  // sm90 mainloops do for MN-major operands.
  using LayoutB = conditional_t<
      Transposed,
      decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, make_shape(Int<BN>{}, Int<BK>{}, Int<kStages>{}))),
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, make_shape(Int<BN>{}, Int<BK>{}, Int<kStages>{}),
                             Step<_2, _1, _3>{}))>;
  // The wgmma warpgroups stack along M: warpgroup g owns rows [64 g, 64 g + 64) of the tile.
  using Mma = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<BN>, Int<BK>>, GMMA::Major::K, kMajorB>(),
      Layout<Shape<Int<kConsumers>, _1, _1>>{}));

  struct alignas(1024) Shared {
    // 128-byte swizzles repeat every 1024 bytes and wgmma applies them to the absolute shared
    // address, so every stage starts on a 1024-byte boundary (each is a multiple of 1024 bytes).
    array_aligned<Element, cosize_v<LayoutA>, 1024> a;
    array_aligned<Element, cosize_v<LayoutB>, 1024> b;
    uint64_t full[kStages];   // producer -> consumers: the stage's copies have landed
    uint64_t empty[kStages];  // consumers -> producer: the stage's wgmmas have read it
    uint64_t tile_full[kTileSlots];   // the block's next tile is in tile_id[i]
    uint64_t tile_empty[kTileSlots];  // every thread has read tile_id[i]
    int tile_id[kTileSlots];
  };

  // + 1024: the dynamic shared window is aligned up to 1024 bytes at run time.
  static constexpr int kSharedBytes = int(sizeof(Shared)) + 1024;
};

// One 16-byte global -> shared copy through L2 only; valid = false writes 16 zero bytes and reads
// nothing (src-size 0: the masked tails and the slots past the last row).
__device__ __forceinline__ void copy16(uint32_t smem, void const *gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem), "l"(gmem), "r"(valid ? 16 : 0)
               : "memory");
}

// x[i] for i in [0, 4) known only at run time, without indexing an array (local memory).
__device__ __forceinline__ float select4(int i, float x0, float x1, float x2, float x3) {
  return i == 0 ? x0 : i == 1 ? x1 : i == 2 ? x2 : x3;
}

// Byte offset of element (mn, k) of stage s in a (MN, K, stage) GMMA shared layout. Such a layout
// carries its swizzle for the shared address in bytes (Swizzle<3,4,3>: the 16-byte column inside a
// 128-byte row XOR the row inside 1024 bytes), so it is applied here to the unswizzled byte offset;
// a 1024-byte aligned base keeps it equal to what wgmma applies to the absolute address.
template <class L>
constexpr int byte_offset(int mn, int k, int s) {
  return int(L{}.layout_a()(int(L{}.layout_b()(mn, k, s)) * int(sizeof(Element))));
}

// True if moving by (d_mn, d_k) moves every 16-byte piece of a stage (contiguous along MN if
// mn_major, else along K) by the same number of bytes: a thread's copies then differ by
// compile-time offsets (immediates in the copy instructions, not one live register per copy).
template <class L, int MN, int K, bool MnMajor>
constexpr bool moves_evenly(int d_mn, int d_k, int bytes) {
  for (int mn = 0; mn + d_mn < MN; mn += MnMajor ? kVector : 1)
    for (int k = 0; k + d_k < K; k += MnMajor ? 1 : kVector)
      if (byte_offset<L>(mn + d_mn, k + d_k, 0) - byte_offset<L>(mn, k, 0) != bytes) return false;
  return true;
}

// The ring position of step t: stage t % S, parity of the pass (t / S) over the ring.
struct Ring {
  int stage = 0;
  uint32_t phase = 0;
  __device__ void advance(int stages = kStages) {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// The block's next tile, the same for every thread: one thread takes it from the launch's counter
// (tiles go to whichever block is free, as a block-per-tile launch would have it, since tiles
// differ several times in cost) and hands it over through a two-slot mailbox in shared memory.
template <class Shared>
__device__ int next_tile(Shared &shared, Ring &mailbox, bool takes, int *counter) {
  using Barrier = cutlass::arch::ClusterBarrier;
  if (takes) {
    Barrier::wait(&shared.tile_empty[mailbox.stage], mailbox.phase ^ 1);
    shared.tile_id[mailbox.stage] = atomicAdd(counter, 1) + int(gridDim.x);
    Barrier::arrive(&shared.tile_full[mailbox.stage]);
  }
  Barrier::wait(&shared.tile_full[mailbox.stage], mailbox.phase);
  int const tile = shared.tile_id[mailbox.stage];
  Barrier::arrive(&shared.tile_empty[mailbox.stage]);
  mailbox.advance(kTileSlots);
  return tile;
}

template <bool Transposed>
__device__ void rows_gemm(Element const *__restrict__ a, Element const *__restrict__ w, int const *__restrict__ table,
                          int const *__restrict__ order, int const *__restrict__ active, int const *__restrict__ count,
                          Element *__restrict__ d, int rows, int zero_row, int reduce, int cols, int list_len,
                          int accumulate, int *__restrict__ next) {
  using Ops = Operands<Transposed>;
  using Barrier = cutlass::arch::ClusterBarrier;
  extern __shared__ unsigned char smem_raw[];
  // Align the window ourselves rather than trust the base of dynamic shared memory.
  uint32_t base = cute::cast_smem_ptr_to_uint(smem_raw);
  auto &shared = *reinterpret_cast<typename Ops::Shared *>(smem_raw + ((1024 - (base & 1023)) & 1023));

  Tensor sA = make_tensor(make_smem_ptr(shared.a.data()), typename Ops::LayoutA{});  // (BM, BK, stage)
  Tensor sB = make_tensor(make_smem_ptr(shared.b.data()), typename Ops::LayoutB{});  // (BN, BK, stage)

  // Persistent: block b takes tile b, then whatever next_tile hands it (any grid works; one block
  // an SM keeps the ring running across tiles, so the next tile's gathers go out during this
  // one's epilogue).
  int const tiles_n = (cols + BN - 1) / BN;
  int const tiles = (rows + BM - 1) / BM * tiles_n;
  int const k_blocks = (reduce + BK - 1) / BK;
  int const warpgroup = threadIdx.x / kWarpgroup;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Barrier::init(&shared.full[s], kWarpgroup);                 // one cp.async arrival per gathering thread
      Barrier::init(&shared.empty[s], kWarpgroup * kConsumers);  // one arrival per wgmma thread
    }
    for (int s = 0; s < kTileSlots; ++s) {
      Barrier::init(&shared.tile_full[s], 1);
      Barrier::init(&shared.tile_empty[s], kThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ------------------------------------------------------------ producer: gather A, load B_k
    if constexpr (kConsumers > 1) cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    using LayoutA = typename Ops::LayoutA;
    using LayoutB = typename Ops::LayoutB;
    int const thread = threadIdx.x;
    constexpr int kStageA = byte_offset<LayoutA>(0, 0, 1), kStageB = byte_offset<LayoutB>(0, 0, 1);
    uint32_t const smem_a = cute::cast_smem_ptr_to_uint(shared.a.data());

    // A: eight threads per gathered row, one 16-byte piece of its BK channels each, so that every
    // copy instruction of a warp reads 4 whole 128-byte lines (a layout with fewer threads per
    // row touches more lines per instruction, and the load pipeline, not the bytes, becomes the
    // limit: 2 threads a row, 16 rows an instruction, ran 3.6x slower on an H200). A thread owns
    // rows a_row + 16 i, all at the same swizzle phase, so its copies differ by immediates.
    constexpr int kThreadsPerRowA = BK / kVector, kRowsPerPassA = kWarpgroup / kThreadsPerRowA;
    constexpr int kRowsA = BM / kRowsPerPassA;
    constexpr int kPassBytesA = kRowsPerPassA * BK * int(sizeof(Element));
    static_assert(moves_evenly<LayoutA, BM, BK, false>(kRowsPerPassA, 0, kPassBytesA), "A passes a swizzle period apart");
    int const a_row = thread / kThreadsPerRowA, a_piece = (thread % kThreadsPerRowA) * kVector;
    uint32_t const a_smem = smem_a + byte_offset<LayoutA>(a_row, a_piece, 0);

    // B: one thread copies the stage's whole tile of the packed W (sc90_pack_*: each tile of B_k
    // is already in the swizzled order of a stage, BN x BK contiguous elements) with one bulk
    // copy that completes on the stage's "full" barrier. 16 cp.async a thread for a 256 x 64
    // tile, beside the gathers, kept the gathering warps from issuing; this is one instruction.
    constexpr uint32_t kTileBytesB = BN * BK * sizeof(Element);
    static_assert(kStageB == int(kTileBytesB), "a stage of B is one contiguous tile");
    bool const copies_b = thread == 0;
    long long const b_tile_step = (long long)tiles_n * BN * BK;  // tile (k, kb, nb) to (k, kb + 1, nb)
    Ring ring, mailbox;
    for (int tile = blockIdx.x; tile < tiles; tile = next_tile(shared, mailbox, thread == 0, next)) {
      int const pid_m = tile / tiles_n, pid_n = tile % tiles_n;
      int const m0 = pid_m * BM;
      int const listed = count[pid_m];
      if (listed == 0) continue;
      Element const *const b_tiles = w + (long long)pid_n * BN * BK;  // tile (k, kb, pid_n) of W_packed
      int const *const offsets = active + (long long)pid_m * list_len;
      if (accumulate && thread < BM) {
        // The epilogue will read this tile's output rows: bring them into L2 while it multiplies.
        int const slot = m0 + thread;
        if (slot < rows) {
          Element const *row = d + (long long)order[slot] * cols + pid_n * BN;
          int const bytes = min(BN, cols - pid_n * BN) * int(sizeof(Element));
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(row), "r"(bytes) : "memory");
        }
      }
      // Source rows of the current and of the next listed offset: the next offset's table entries
      // load while this one's copies go out, and the offset after that is read one offset earlier.
      int source[kRowsA], upcoming[kRowsA];
      int k = offsets[0];
      int k_next = listed > 1 ? offsets[1] : 0;
      CUTE_UNROLL
      for (int i = 0; i < kRowsA; ++i) {
        int slot = m0 + a_row + kRowsPerPassA * i;
        source[i] = slot < rows ? table[(long long)k * rows + slot] : -1;
      }
      for (int j = 0; j < listed; ++j) {
        int k_after = 0;
        if (j + 1 < listed) {
          CUTE_UNROLL
          for (int i = 0; i < kRowsA; ++i) {
            int slot = m0 + a_row + kRowsPerPassA * i;
            upcoming[i] = slot < rows ? table[(long long)k_next * rows + slot] : -1;
          }
          if (j + 2 < listed) k_after = offsets[j + 2];
        }
        Element const *const b_k = b_tiles + (long long)k * k_blocks * b_tile_step;
        for (int kb = 0; kb < k_blocks; ++kb) {
          Barrier::wait(&shared.empty[ring.stage], ring.phase ^ 1);  // a fresh barrier passes parity 1
          if (copies_b) {
            // Before this thread's arrival below, so the phase cannot complete without the bytes.
            cutlass::arch::ClusterTransactionBarrier::expect_transaction(&shared.full[ring.stage], kTileBytesB);
            SM90_BULK_COPY_G2S::copy(b_k + kb * b_tile_step, &shared.full[ring.stage],
                                     shared.b.data() + ring.stage * (kStageB / int(sizeof(Element))), kTileBytesB);
          }
          int const c0 = kb * BK;
          bool const piece_in = c0 + a_piece < reduce;
          CUTE_UNROLL
          for (int i = 0; i < kRowsA; ++i) {
            // The zero row is never read: a copy of size 0 fills the same zeros without an L2
            // request (a quarter of the gathered rows, all on one line, would queue on one slice).
            bool ok = piece_in && source[i] >= 0 && source[i] != zero_row;
            copy16(a_smem + ring.stage * kStageA + i * kPassBytesA,
                   ok ? a + (long long)source[i] * reduce + c0 + a_piece : a, ok);
          }
          cutlass::arch::cpasync_barrier_arrive_noinc(&shared.full[ring.stage]);
          ring.advance();
        }
        CUTE_UNROLL
        for (int i = 0; i < kRowsA; ++i) source[i] = upcoming[i];
        k = k_next;
        k_next = k_after;
      }
    }
    // Leave no copy in flight behind an exiting thread.
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  } else {
    // ------------------------------------------------------------ consumers: wgmma + epilogue
    if constexpr (kConsumers > 1) cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    int const thread = threadIdx.x - kWarpgroup;
    typename Ops::Mma mma;
    auto thread_mma = mma.get_slice(thread);
    Tensor tCsA = thread_mma.partition_A(sA);  // (MMA, MMA_M, MMA_K, stage)
    Tensor tCsB = thread_mma.partition_B(sB);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tCrA = thread_mma.make_fragment_A(tCsA);  // wgmma descriptors
    Tensor tCrB = thread_mma.make_fragment_B(tCsB);
    Tensor acc = partition_fragment_C(mma, Shape<Int<BM>, Int<BN>>{});  // ((2, 2, BN / 8), 1, 1) fp32
    mma.accumulate_ = GMMA::ScaleOut::One;
    // Each thread holds pairs of adjacent columns of two rows 8 apart (value modes (2, 2, BN / 8)
    // of the wgmma accumulator: +1 column, +8 rows, +8 columns); the checks below pin that.
    using CLayout = typename Ops::Mma::Atom::LayoutC_TV;  // (thread, value) -> m + 64 n
    static_assert(decltype(stride<1, 0>(CLayout{}))::value == 64 && decltype(stride<1, 1>(CLayout{}))::value == 8 &&
                      decltype(stride<1, 2>(CLayout{}))::value == 512,
                  "unexpected wgmma accumulator layout");
    static_assert(decltype(size<0, 2>(acc))::value == BN / 8 && decltype(size<1>(acc))::value == 1 &&
                      decltype(size<2>(acc))::value == 1,
                  "one wgmma tile per warpgroup");
    Tensor coords = thread_mma.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));

    Ring ring, release, mailbox;
    for (int tile = blockIdx.x; tile < tiles; tile = next_tile(shared, mailbox, false, next)) {
      int const pid_m = tile / tiles_n, pid_n = tile % tiles_n;
      int const m0 = pid_m * BM, n0 = pid_n * BN;
      int const steps = count[pid_m] * k_blocks;
      if (accumulate && steps == 0) continue;  // nothing to add
      clear(acc);
      for (int t = 0; t < steps; ++t) {
        Barrier::wait(&shared.full[ring.stage], ring.phase);
        // cp.async writes through the generic proxy and wgmma reads through the async proxy, and
        // a gathering thread cannot fence copies that land after it has moved on: order the
        // stage's writes, acquired through the barrier, before this thread's wgmmas here instead.
        cutlass::arch::fence_view_async_shared();
        warpgroup_fence_operand(acc);
        warpgroup_arrive();
        gemm(mma, tCrA(_, _, _, ring.stage), tCrB(_, _, _, ring.stage), acc);
        warpgroup_commit_batch();
        // At most this batch in flight: the previous one has read its stage, hand that stage back.
        warpgroup_wait<1>();
        warpgroup_fence_operand(acc);
        if (t > 0) {
          Barrier::arrive(&shared.empty[release.stage]);
          release.advance();
        }
        ring.advance();
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc);
      if (steps > 0) {  // the tile's last stage: the producer may refill it during the epilogue
        Barrier::arrive(&shared.empty[release.stage]);
        release.advance();
      }

      long long out_row[2];
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        int slot = m0 + get<0>(coords(make_coord(make_coord(0, half, 0), 0, 0)));
        out_row[half] = slot < rows ? (long long)order[slot] * cols : -1;
      }
      // A quad of lanes holds columns 2 q, 2 q + 1 (q = lane % 4) of every group of 8 columns, for
      // two rows (halves). Three shuffle rounds per chunk of 4 groups hand lane q all 8 columns of
      // the chunk's group q, which it then stores (and, with accumulate, first loads) as one
      // 16-byte vector: a quarter of the store instructions of 4-byte pairs, each filling whole
      // 64-byte pieces of a row (the 4-byte stores spent ~8% of the kernel; check_sm90_rows.py --probe).
      int const quad = thread % 4;
      // accumulate: the old values of a batch of groups are all loaded before any is stored (a
      // store may alias the next load for the compiler, so one at a time would wait a full memory
      // round trip each).
      constexpr int kBatch = SC_EPILOGUE_BATCH;  // chunks of 4 groups a batch
      CUTE_UNROLL
      for (int first = 0; first < BN / 32; first += kBatch) {
        int col[kBatch];
        uint4 old[kBatch][2];
        CUTE_UNROLL
        for (int c = 0; c < kBatch; ++c) {
          // the chunk's group q starts 2 q columns before this lane's pair of it
          col[c] = n0 + get<1>(coords(make_coord(make_coord(0, 0, 4 * (first + c) + quad), 0, 0))) - 2 * quad;
          CUTE_UNROLL
          for (int half = 0; half < 2; ++half)
            old[c][half] = accumulate && col[c] < cols && out_row[half] >= 0
                               ? *reinterpret_cast<uint4 const *>(d + out_row[half] + col[c])
                               : make_uint4(0u, 0u, 0u, 0u);
        }
        CUTE_UNROLL
        for (int c = 0; c < kBatch; ++c) {
          int const g0 = 4 * (first + c);
          CUTE_UNROLL
          for (int half = 0; half < 2; ++half) {
            // got[r]: columns 2 ((q + r) % 4) + {0, 1} of group g0 + q, from lane (q + r) % 4
            float got[4][2];
            CUTE_UNROLL
            for (int r = 0; r < 4; ++r) {
              int const send = (quad - r) & 3;  // the group whose pair lane (q - r) % 4 wants
              CUTE_UNROLL
              for (int v = 0; v < 2; ++v) {
                float x = select4(send, acc(make_coord(make_coord(v, half, g0), 0, 0)),
                                  acc(make_coord(make_coord(v, half, g0 + 1), 0, 0)),
                                  acc(make_coord(make_coord(v, half, g0 + 2), 0, 0)),
                                  acc(make_coord(make_coord(v, half, g0 + 3), 0, 0)));
                got[r][v] = r == 0 ? x : __shfl_sync(0xffffffffu, x, (quad + r) & 3, 4);
              }
            }
            uint32_t pair[4];
            uint32_t const was[4] = {old[c][half].x, old[c][half].y, old[c][half].z, old[c][half].w};
            CUTE_UNROLL
            for (int p = 0; p < 4; ++p) {  // columns 2 p, 2 p + 1 arrived in round (p - q) % 4
              int const r = (p - quad) & 3;
              float lo = select4(r, got[0][0], got[1][0], got[2][0], got[3][0]);
              float hi = select4(r, got[0][1], got[1][1], got[2][1], got[3][1]);
              if (accumulate) {
                lo += float(Element::bitcast(uint16_t(was[p] & 0xffffu)));
                hi += float(Element::bitcast(uint16_t(was[p] >> 16)));
              }
              pair[p] = uint32_t(Element(lo).raw()) | (uint32_t(Element(hi).raw()) << 16);
            }
            // cols % 8 == 0: a group is wholly inside or wholly past the last column
            bool store = col[c] < cols && out_row[half] >= 0;
            if (store) *reinterpret_cast<uint4 *>(d + out_row[half] + col[c]) = make_uint4(pair[0], pair[1], pair[2], pair[3]);
          }
        }
      }
    }
  }
}

// W_packed of sc90_rows_ab / sc90_rows_abt: tile (k, kb, nb) of B_k, that is rows kb * BK.. and
// columns nb * BN.. of W_k (ab) or W_k^T (abt), stored as the BN x BK elements of one shared
// stage in that stage's swizzled order, zeros past the ends of W; tiles ordered (k, kb, nb).
// Also zeroes counters[0, num_counters), the tile counters of the products that follow.
template <bool Transposed>
__device__ void pack_b(Element const *__restrict__ w, Element *__restrict__ packed, int num_offsets, int reduce,
                       int cols, int *__restrict__ counters, int num_counters) {
  if (blockIdx.x == 0 && int(threadIdx.x) < num_counters) counters[threadIdx.x] = 0;
  using LayoutB = typename Operands<Transposed>::LayoutB;
  int const k_blocks = (reduce + BK - 1) / BK, tiles_n = (cols + BN - 1) / BN;
  long long const total = (long long)num_offsets * k_blocks * tiles_n * BN * BK;
  for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < total;
       e += (long long)gridDim.x * blockDim.x) {
    int const kk = int(e % BK), n = int(e / BK % BN);
    long long const tile = e / (BN * BK);
    int const nb = int(tile % tiles_n), kb = int(tile / tiles_n % k_blocks), k = int(tile / tiles_n / k_blocks);
    int const c = kb * BK + kk, col = nb * BN + n;
    Element value = Element(0.f);
    if (c < reduce && col < cols)
      value = Transposed ? w[((long long)k * cols + col) * reduce + c] : w[((long long)k * reduce + c) * cols + col];
    packed[tile * BN * BK + byte_offset<LayoutB>(n, kk, 0) / int(sizeof(Element))] = value;
  }
}

}  // namespace sc90

extern "C" __global__ void __launch_bounds__(sc90::kThreads, 1)
sc90_rows_ab(Element const *a, Element const *w_packed, int const *table, int const *order, int const *active,
             int const *count, Element *d, int rows, int reduce, int cols, int sources, int list_len,
             int accumulate, int *next) {
  sc90::rows_gemm<false>(a, w_packed, table, order, active, count, d, rows, sources, reduce, cols, list_len, accumulate,
                         next);
}

extern "C" __global__ void __launch_bounds__(sc90::kThreads, 1)
sc90_rows_abt(Element const *a, Element const *w_packed, int const *table, int const *order, int const *active,
              int const *count, Element *d, int rows, int reduce, int cols, int sources, int list_len,
              int accumulate, int *next) {
  sc90::rows_gemm<true>(a, w_packed, table, order, active, count, d, rows, sources, reduce, cols, list_len, accumulate,
                          next);
}

// W (K, reduce, cols) for ab or (K, cols, reduce) for abt -> W_packed, num_offsets * ceil(reduce / BK)
// * ceil(cols / BN) * BN * BK elements; any 1-D launch (a grid-stride loop) of at least num_counters
// threads a block. Also zeroes counters[0, num_counters): the tile counters (`next`) of the
// products that follow it on the stream.
extern "C" __global__ void sc90_pack_ab(Element const *w, Element *packed, int num_offsets, int reduce, int cols,
                                        int *counters, int num_counters) {
  sc90::pack_b<false>(w, packed, num_offsets, reduce, cols, counters, num_counters);
}

extern "C" __global__ void sc90_pack_abt(Element const *w, Element *packed, int num_offsets, int reduce, int cols,
                                        int *counters, int num_counters) {
  sc90::pack_b<true>(w, packed, num_offsets, reduce, cols, counters, num_counters);
}

// {threads per block, dynamic shared bytes} of sc90_rows_ab, sc90_rows_abt.
extern "C" __device__ int sc90_launch_info[2][2] = {
    {sc90::kThreads, sc90::Operands<false>::kSharedBytes},
    {sc90::kThreads, sc90::Operands<true>::kSharedBytes},
};
