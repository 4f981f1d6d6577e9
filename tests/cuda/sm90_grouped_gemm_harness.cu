// Standalone check and timing of the SM90 bf16 grouped GEMM core (kernels/impls/sm90_bf16_grouped_gemm.cuh).
//
//   sm90_grouped_gemm_harness list      print the cases
//   sm90_grouped_gemm_harness <case>    run one case: build the pool, poison C with NaN, run, compare
//                                       with an fp32 reference GEMM on the GPU, time (median of 20
//                                       after warm-up) against cuBLAS on a dense GEMM of the same FLOPs
//
// cuBLAS is loaded at run time (dlopen, DGE_CUBLAS_LIB or libcublas.so.13) so the harness builds
// where only nvcc is installed. Every case prints one line starting with "RESULT".

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <impls/sm90_bf16_grouped_gemm.cuh>

using dge::gemm::EpilogueStoreBF16;
using dge::gemm::GroupedGemmType;
using dge::gemm::Major;
using dge::gemm::SmemLayout;

#define CHECK_CUDA(expr)                                                                                 \
    do {                                                                                                 \
        cudaError_t err_ = (expr);                                                                       \
        if (err_ != cudaSuccess) {                                                                       \
            std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(err_), __FILE__, __LINE__, \
                         cudaGetErrorString(err_));                                                      \
            std::exit(2);                                                                                \
        }                                                                                                \
    } while (0)

// ---------------------------------------------------------------------------------------------
// cuBLAS through dlopen (only the three entry points the ceiling needs).
struct Cublas {
    using CreateFn = int (*)(void**);
    using SetStreamFn = int (*)(void*, cudaStream_t);
    using GemmExFn = int (*)(void*, int, int, int, int, int, const void*, const void*, int, int, const void*, int,
                             int, const void*, void*, int, int, int, int);
    static constexpr int kOpN = 0, kOpT = 1, kR16BF = 14, kCompute32F = 68, kAlgoDefaultTensorOp = 99;
    void* handle = nullptr;
    GemmExFn gemm_ex = nullptr;

    bool load() {
        const char* env = std::getenv("DGE_CUBLAS_LIB");
        void* lib = dlopen(env ? env : "libcublas.so.13", RTLD_NOW);
        if (!lib)
            lib = dlopen("libcublas.so", RTLD_NOW);
        if (!lib) {
            std::fprintf(stderr, "cuBLAS not found (%s); set DGE_CUBLAS_LIB\n", dlerror());
            return false;
        }
        auto create = reinterpret_cast<CreateFn>(dlsym(lib, "cublasCreate_v2"));
        gemm_ex = reinterpret_cast<GemmExFn>(dlsym(lib, "cublasGemmEx"));
        return create && gemm_ex && create(&handle) == 0;
    }

    // Row-major C[M, N] = A[M, K] @ W[N, K]^T, i.e. column-major C^T = W^T(op T) * A^T.
    int gemm_nt(const __nv_bfloat16* a, const __nv_bfloat16* w, __nv_bfloat16* c, int m, int n, int k) const {
        const float alpha = 1.0f, beta = 0.0f;
        return gemm_ex(handle, kOpT, kOpN, n, m, k, &alpha, w, kR16BF, k, a, kR16BF, k, &beta, c, kR16BF, n,
                       kCompute32F, kAlgoDefaultTensorOp);
    }
};

// ---------------------------------------------------------------------------------------------
// Tensor maps through the driver entry point (no -lcuda needed).
using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

static EncodeTiledFn encode_tiled() {
    static EncodeTiledFn fn = nullptr;
    if (!fn) {
        cudaDriverEntryPointQueryResult status;
        void* ptr = nullptr;
        CHECK_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status));
        if (status != cudaDriverEntryPointSuccess || !ptr) {
            std::fprintf(stderr, "cuTensorMapEncodeTiled not available\n");
            std::exit(2);
        }
        fn = reinterpret_cast<EncodeTiledFn>(ptr);
    }
    return fn;
}

// The kernel's one tensor-map shape: a row-major bf16 [rows, cols] view, 64 x 64 boxes, 128B swizzle.
static CUtensorMap make_tma_2d(const void* base, uint64_t rows, uint64_t cols) {
    CUtensorMap map;
    const cuuint64_t dims[2] = {cols, rows};
    const cuuint64_t strides[1] = {cols * 2};
    const cuuint32_t box[2] = {64, 64};
    const cuuint32_t elem_strides[2] = {1, 1};
    const CUresult res = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims,
                                        strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                        CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (res != CUDA_SUCCESS) {
        std::fprintf(stderr, "cuTensorMapEncodeTiled failed (%d) for [%llu, %llu]\n", static_cast<int>(res),
                     static_cast<unsigned long long>(rows), static_cast<unsigned long long>(cols));
        std::exit(2);
    }
    return map;
}

// ---------------------------------------------------------------------------------------------
// Data: uniform(-1, 1) from a hash of (seed, index); rows whose mask is 0 are zero (pool padding).
__device__ __forceinline__ float hash_uniform(uint64_t seed, uint64_t i) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 32;
    return static_cast<float>(x & 0xFFFFFF) / 8388608.0f - 1.0f;
}

__global__ void fill_random(__nv_bfloat16* out, uint64_t n, uint64_t cols, uint64_t seed, const uint8_t* row_mask) {
    for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
        const bool zero = row_mask != nullptr && row_mask[i / cols] == 0;
        out[i] = __float2bfloat16(zero ? 0.0f : hash_uniform(seed, i));
    }
}

enum class Kind { NT, NN, KG };

// fp32 reference, 64 x 64 output tiles, 4 x 4 per thread. M-grouped: output rows are pool rows,
// row_expert[r] < 0 rows are left alone. K-grouped: output rows are e * M + m.
template <Kind kKind>
__global__ void __launch_bounds__(256) reference_gemm(const __nv_bfloat16* a, const __nv_bfloat16* b, float* out,
                                                      const int* row_expert, const int* starts, const int* ends,
                                                      int n_dim, int k_dim, int m_dim) {
    __shared__ float as[16][65];
    __shared__ float bs[16][65];
    const int row0 = blockIdx.y * 64, col0 = blockIdx.x * 64;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int expert, k_begin, k_end;
    if constexpr (kKind == Kind::KG) {
        expert = row0 / m_dim;
        k_begin = starts[expert];
        k_end = ends[expert];
    } else {
        expert = row_expert[row0];
        k_begin = 0;
        k_end = k_dim;
    }
    if (expert < 0)
        return;
    float acc[4][4] = {};
    for (int k0 = k_begin; k0 < k_end; k0 += 16) {
        // Consecutive threads walk the contiguous dimension of each operand.
        for (int i = threadIdx.x; i < 16 * 64; i += 256) {
            int kk, mm;
            if constexpr (kKind == Kind::KG) {
                kk = i / 64, mm = i % 64;
            } else {
                kk = i % 16, mm = i / 16;
            }
            const int k = k0 + kk;
            float av = 0.0f;
            if (k < k_end)
                av = kKind == Kind::KG ? __bfloat162float(a[static_cast<int64_t>(k) * m_dim + (row0 % m_dim) + mm])
                                       : __bfloat162float(a[static_cast<int64_t>(row0 + mm) * k_dim + k]);
            as[kk][mm] = av;
        }
        for (int i = threadIdx.x; i < 16 * 64; i += 256) {
            int kk, nn;
            if constexpr (kKind == Kind::NT) {
                kk = i % 16, nn = i / 16;
            } else {
                kk = i / 64, nn = i % 64;
            }
            const int k = k0 + kk, n = col0 + nn;
            float bv = 0.0f;
            if (k < k_end && n < n_dim) {
                int64_t idx;
                if constexpr (kKind == Kind::NT)
                    idx = (static_cast<int64_t>(expert) * n_dim + n) * k_dim + k;
                else if constexpr (kKind == Kind::NN)
                    idx = (static_cast<int64_t>(expert) * k_dim + k) * n_dim + n;
                else
                    idx = static_cast<int64_t>(k) * n_dim + n;
                bv = __bfloat162float(b[idx]);
            }
            bs[kk][nn] = bv;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < 16; ++kk) {
            float ar[4], br[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                ar[i] = as[kk][ty + 16 * i];
                br[i] = bs[kk][tx + 16 * i];
            }
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    acc[i][j] += ar[i] * br[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int col = col0 + tx + 16 * j;
            if (col < n_dim)
                out[static_cast<int64_t>(row0 + ty + 16 * i) * n_dim + col] = acc[i][j];
        }
}

struct Stats {
    double sum_sq_diff, sum_sq_ref, max_abs_diff, max_abs_ref;
    unsigned long long nan_checked, written_unowned;
};

// Rows with row_owned[r] != 0 are compared; the others must still hold the NaN poison.
__global__ void compare(const __nv_bfloat16* c, const float* ref, const uint8_t* row_owned, uint64_t rows,
                        uint64_t cols, Stats* stats) {
    double sq_diff = 0, sq_ref = 0;
    float max_diff = 0, max_ref = 0;
    unsigned long long nans = 0, written = 0;
    for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < rows * cols;
         i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
        const float v = __bfloat162float(c[i]);
        if (row_owned[i / cols]) {
            if (isnan(v)) {
                ++nans;
                continue;
            }
            const float r = ref[i], d = fabsf(v - r);
            sq_diff += static_cast<double>(d) * d;
            sq_ref += static_cast<double>(r) * r;
            max_diff = fmaxf(max_diff, d);
            max_ref = fmaxf(max_ref, fabsf(r));
        } else if (!isnan(v)) {
            ++written;
        }
    }
    for (int off = 16; off > 0; off /= 2) {
        sq_diff += __shfl_xor_sync(0xffffffff, sq_diff, off);
        sq_ref += __shfl_xor_sync(0xffffffff, sq_ref, off);
        max_diff = fmaxf(max_diff, __shfl_xor_sync(0xffffffff, max_diff, off));
        max_ref = fmaxf(max_ref, __shfl_xor_sync(0xffffffff, max_ref, off));
        nans += __shfl_xor_sync(0xffffffff, nans, off);
        written += __shfl_xor_sync(0xffffffff, written, off);
    }
    if (threadIdx.x % 32 == 0) {
        atomicAdd(&stats->sum_sq_diff, sq_diff);
        atomicAdd(&stats->sum_sq_ref, sq_ref);
        atomicMax(reinterpret_cast<unsigned long long*>(&stats->max_abs_diff),
                  __double_as_longlong(static_cast<double>(max_diff)));
        atomicMax(reinterpret_cast<unsigned long long*>(&stats->max_abs_ref),
                  __double_as_longlong(static_cast<double>(max_ref)));
        atomicAdd(&stats->nan_checked, nans);
        atomicAdd(&stats->written_unowned, written);
    }
}

// ---------------------------------------------------------------------------------------------
struct Problem {
    const char* name;
    Kind kind;
    int experts;
    int slots;          // routed (token, k) pairs spread over the experts
    int m;              // K-grouped: rows of each dW[e]
    int n;
    int k;              // M-grouped: contraction
    int empty_every;    // every empty_every-th expert gets no rows (0: none)
    bool zipf;          // skewed expert popularity
    int tail_rows;      // pool rows past ends[E-1], owned by nobody
};

struct Pool {
    std::vector<int> counts, starts, ends;
    int rows = 0;       // pool rows P (incl. tail)
};

static Pool make_pool(const Problem& p, uint64_t seed) {
    Pool pool;
    std::mt19937_64 rng(seed);
    std::vector<double> weight(p.experts);
    for (int e = 0; e < p.experts; ++e) {
        const bool empty = p.empty_every > 0 && e % p.empty_every == p.empty_every - 1;
        weight[e] = empty ? 0.0 : (p.zipf ? 1.0 / std::pow(e + 1.0, 1.2) : 1.0);
    }
    std::discrete_distribution<int> pick(weight.begin(), weight.end());
    pool.counts.assign(p.experts, 0);
    for (int s = 0; s < p.slots; ++s)
        ++pool.counts[pick(rng)];
    int row = 0;
    for (int e = 0; e < p.experts; ++e) {
        pool.starts.push_back(row);
        row += (pool.counts[e] + 127) / 128 * 128;
        pool.ends.push_back(row);
    }
    pool.rows = row + p.tail_rows;
    return pool;
}

template <typename T>
static T* device_copy(const std::vector<T>& v) {
    T* d = nullptr;
    CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(1, v.size()) * sizeof(T)));
    if (!v.empty())
        CHECK_CUDA(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

static double median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

template <GroupedGemmType kType, Major kMajorA, Major kMajorB, uint32_t BLOCK_N, uint32_t kStages, uint32_t kClusterN_,
          bool kPairedN_>
struct Config {
    static constexpr uint32_t kGroupM = 16;
    static constexpr uint32_t kClusterN = kClusterN_;
    static constexpr uint32_t kBlockN = BLOCK_N;
    static constexpr bool kPairedN = kPairedN_;
    // A typed pointer to a kernel with a __grid_constant__ parameter pack does not convert on the
    // host side; the untyped launch API takes the symbol as const void*.
    static const void* kernel() {
        return reinterpret_cast<const void*>(
            &dge::gemm::sm90_grouped_gemm_kernel<
                dge::gemm::GemmTraits<kType, kMajorA, kMajorB, BLOCK_N, kStages, kClusterN_, kPairedN_, kGroupM>,
                dge::gemm::LoaderTma, dge::gemm::MainloopBF16, EpilogueStoreBF16, CUtensorMap>);
    }
    static constexpr uint32_t kSmem = SmemLayout<BLOCK_N, kStages, EpilogueStoreBF16>::kTotalBytes;

    static std::string name() {
        char buf[96];
        std::snprintf(buf, sizeof(buf), "%s BN%u S%u C%u%s",
                      kType == GroupedGemmType::KGroupedContiguous ? "kg"
                      : kMajorB == Major::K                       ? "nt"
                                                                  : "nn",
                      BLOCK_N, kStages, kClusterN_, kPairedN_ ? " paired" : "");
        return buf;
    }
};

template <class Cfg>
static void run_case(const Problem& p, int num_reps, bool with_cublas) {
    const uint64_t seed = 0x5EED0000ull + static_cast<uint64_t>(p.n) * 131 + p.k * 7 + p.m;
    const Pool pool = make_pool(p, seed);
    const int E = p.experts, P = pool.rows, N = p.n;
    const bool kgrouped = p.kind == Kind::KG;
    const int M_out = kgrouped ? E * p.m : P;        // rows of C

    // Host-side contract checks the Python launcher also makes.
    if (N % 8 != 0 || (!kgrouped && p.k % 8 != 0) || (kgrouped && p.m % 128 != 0)) {
        std::fprintf(stderr, "unsupported shape\n");
        std::exit(2);
    }

    std::vector<uint8_t> real_row(P, 0), owned_row(M_out, 0);
    std::vector<int> row_expert(P, -1);
    for (int e = 0; e < E; ++e)
        for (int r = pool.starts[e]; r < pool.ends[e]; ++r) {
            real_row[r] = r < pool.starts[e] + pool.counts[e];
            row_expert[r] = e;
        }
    for (int r = pool.ends[E - 1]; r < P; ++r)
        real_row[r] = 1;  // tail rows hold data nobody may read
    if (kgrouped)
        std::fill(owned_row.begin(), owned_row.end(), 1);
    else
        for (int r = 0; r < P; ++r)
            owned_row[r] = row_expert[r] >= 0;

    int *d_starts = device_copy(pool.starts), *d_ends = device_copy(pool.ends), *d_row_expert = device_copy(row_expert);
    uint8_t *d_real = device_copy(real_row), *d_owned = device_copy(owned_row);

    // Operands.
    const uint64_t a_cols = kgrouped ? p.m : p.k;
    const uint64_t a_elems = static_cast<uint64_t>(P) * a_cols;
    const uint64_t b_rows = kgrouped ? P : (p.kind == Kind::NT ? static_cast<uint64_t>(E) * N : static_cast<uint64_t>(E) * p.k);
    const uint64_t b_cols = kgrouped ? N : (p.kind == Kind::NT ? p.k : N);
    const uint64_t b_elems = b_rows * b_cols;
    const uint64_t c_elems = static_cast<uint64_t>(M_out) * N;
    __nv_bfloat16 *a, *b, *c;
    float* ref;
    CHECK_CUDA(cudaMalloc(&a, a_elems * 2));
    CHECK_CUDA(cudaMalloc(&b, b_elems * 2));
    CHECK_CUDA(cudaMalloc(&c, c_elems * 2));
    CHECK_CUDA(cudaMalloc(&ref, c_elems * 4));
    fill_random<<<4096, 256>>>(a, a_elems, a_cols, seed ^ 0xA, d_real);
    fill_random<<<4096, 256>>>(b, b_elems, b_cols, seed ^ 0xB, kgrouped ? d_real : nullptr);
    CHECK_CUDA(cudaGetLastError());

    const CUtensorMap tma_a = make_tma_2d(a, P, a_cols);
    const CUtensorMap tma_b = make_tma_2d(b, b_rows, b_cols);
    const CUtensorMap tma_c = make_tma_2d(c, M_out, N);

    const int num_n_blocks = Cfg::kPairedN ? N / static_cast<int>(Cfg::kBlockN) : (N + Cfg::kBlockN - 1) / Cfg::kBlockN;
    if (num_n_blocks % static_cast<int>(Cfg::kClusterN) != 0 || (Cfg::kPairedN && N % Cfg::kBlockN != 0)) {
        std::printf("RESULT %-9s | %-18s | SKIP: %d N blocks do not fit the config\n", p.name, Cfg::name().c_str(),
                    num_n_blocks);
        return;
    }

    // Launch configuration: persistent grid, clusters along N.
    int num_sms = 0;
    CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK_CUDA(cudaFuncSetAttribute(Cfg::kernel(), cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmem));
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    constexpr uint32_t kClusterN = Cfg::kClusterN;
    cfg.blockDim = dim3(dge::gemm::kNumThreads);
    cfg.dynamicSmemBytes = Cfg::kSmem;
    cfg.stream = nullptr;
    int grid = num_sms;
    if constexpr (kClusterN > 1) {
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = kClusterN;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        cfg.gridDim = dim3(num_sms / kClusterN * kClusterN);
        int max_clusters = 0;
        CHECK_CUDA(cudaOccupancyMaxActiveClusters(&max_clusters, Cfg::kernel(), &cfg));
        grid = std::min(num_sms / static_cast<int>(kClusterN), max_clusters) * kClusterN;
    }
    cfg.gridDim = dim3(grid);

    const uint32_t shape_m = kgrouped ? p.m : P;
    const uint32_t shape_k = kgrouped ? P : p.k;
    const int* starts_arg = d_starts;
    const int* ends_arg = d_ends;
    uint32_t experts_arg = E, n_arg = N;
    CUtensorMap tma_a_arg = tma_a, tma_b_arg = tma_b, tma_c_arg = tma_c;
    const int* gather_arg = d_starts;  // no gathering prologue: any valid pointer
    uint32_t gather_top_k_arg = 1;
    const void* gather_x_arg = d_starts;
    uint32_t gather_x_rows_arg = 0;
    void* args[] = {&starts_arg, &ends_arg, &experts_arg, const_cast<uint32_t*>(&shape_m), &n_arg,
                    const_cast<uint32_t*>(&shape_k), &gather_arg, &gather_top_k_arg, &gather_x_arg,
                    &gather_x_rows_arg, &tma_a_arg, &tma_b_arg, &tma_c_arg};
    auto launch = [&] { CHECK_CUDA(cudaLaunchKernelExC(&cfg, Cfg::kernel(), args)); };

    // Correctness: NaN-poisoned C, one run, fp32 reference.
    CHECK_CUDA(cudaMemset(c, 0xFF, c_elems * 2));
    launch();
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());
    const dim3 ref_grid((N + 63) / 64, M_out / 64);
    if (M_out % 64 != 0) {
        std::fprintf(stderr, "reference needs rows %% 64 == 0\n");
        std::exit(2);
    }
    CHECK_CUDA(cudaMemset(ref, 0, c_elems * 4));
    if (p.kind == Kind::NT)
        reference_gemm<Kind::NT><<<ref_grid, 256>>>(a, b, ref, d_row_expert, d_starts, d_ends, N, p.k, p.m);
    else if (p.kind == Kind::NN)
        reference_gemm<Kind::NN><<<ref_grid, 256>>>(a, b, ref, d_row_expert, d_starts, d_ends, N, p.k, p.m);
    else
        reference_gemm<Kind::KG><<<ref_grid, 256>>>(a, b, ref, d_row_expert, d_starts, d_ends, N, p.k, p.m);
    CHECK_CUDA(cudaGetLastError());
    Stats* d_stats;
    CHECK_CUDA(cudaMalloc(&d_stats, sizeof(Stats)));
    CHECK_CUDA(cudaMemset(d_stats, 0, sizeof(Stats)));
    compare<<<2048, 256>>>(c, ref, d_owned, M_out, N, d_stats);
    CHECK_CUDA(cudaGetLastError());
    Stats st;
    CHECK_CUDA(cudaMemcpy(&st, d_stats, sizeof(Stats), cudaMemcpyDeviceToHost));
    const double rel = std::sqrt(st.sum_sq_diff / std::max(st.sum_sq_ref, 1e-30));
    const double max_rel = st.max_abs_diff / std::max(st.max_abs_ref, 1e-30);
    const bool ok = st.nan_checked == 0 && st.written_unowned == 0 && rel < 5e-3 && max_rel < 2e-2 &&
                    st.sum_sq_ref > 0;

    // Timing.
    const double used_rows = pool.ends[E - 1];
    const double flops = kgrouped ? 2.0 * used_rows * p.m * N : 2.0 * used_rows * N * p.k;
    std::vector<cudaEvent_t> ev(2 * num_reps);
    for (auto& e : ev)
        CHECK_CUDA(cudaEventCreate(&e));
    auto time_it = [&](auto&& fn) {
        for (int i = 0; i < 3; ++i)
            fn();
        std::vector<float> ms(num_reps);
        for (int i = 0; i < num_reps; ++i) {
            CHECK_CUDA(cudaEventRecord(ev[2 * i]));
            fn();
            CHECK_CUDA(cudaEventRecord(ev[2 * i + 1]));
        }
        CHECK_CUDA(cudaEventSynchronize(ev.back()));
        for (int i = 0; i < num_reps; ++i)
            CHECK_CUDA(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
        CHECK_CUDA(cudaGetLastError());
        return median(ms);
    };
    const double ms = time_it(launch);
    double cublas_ms = 0;
    if (with_cublas) {
        // Dense ceiling with the same FLOPs: [rows, K] x [N, K]^T (M-grouped) or [rows, M]^T-sized (K-grouped).
        Cublas cublas;
        if (cublas.load()) {
            const int dm = static_cast<int>(used_rows), dn = N, dk = kgrouped ? p.m : p.k;
            __nv_bfloat16 *da, *dw, *dc;
            CHECK_CUDA(cudaMalloc(&da, static_cast<uint64_t>(dm) * dk * 2));
            CHECK_CUDA(cudaMalloc(&dw, static_cast<uint64_t>(dn) * dk * 2));
            CHECK_CUDA(cudaMalloc(&dc, static_cast<uint64_t>(dm) * dn * 2));
            fill_random<<<4096, 256>>>(da, static_cast<uint64_t>(dm) * dk, dk, seed ^ 0xC, nullptr);
            fill_random<<<4096, 256>>>(dw, static_cast<uint64_t>(dn) * dk, dk, seed ^ 0xD, nullptr);
            int status = 0;
            cublas_ms = time_it([&] { status |= cublas.gemm_nt(da, dw, dc, dm, dn, dk); });
            if (status != 0)
                cublas_ms = 0;
            CHECK_CUDA(cudaFree(da));
            CHECK_CUDA(cudaFree(dw));
            CHECK_CUDA(cudaFree(dc));
        }
    }
    const double tflops = flops / (ms * 1e-3) / 1e12;
    const double cublas_tflops = cublas_ms > 0 ? flops / (cublas_ms * 1e-3) / 1e12 : 0;
    std::printf("RESULT %-9s | %-18s | E %3d rows %7d N %5d %s %5d | grid %3d smem %6u | rel %.2e max %.2e nan %llu "
                "stray %llu | %s | %8.3f ms %6.1f TFLOP/s | cuBLAS %6.1f | %5.2fx\n",
                p.name, Cfg::name().c_str(), E, static_cast<int>(used_rows), N, kgrouped ? "M" : "K",
                kgrouped ? p.m : p.k, grid, Cfg::kSmem, rel, max_rel, st.nan_checked, st.written_unowned,
                ok ? "PASS" : "FAIL", ms, tflops, cublas_tflops, cublas_tflops > 0 ? tflops / cublas_tflops : 0.0);
    std::fflush(stdout);
    if (!ok)
        std::exit(1);
}

// ---------------------------------------------------------------------------------------------
constexpr auto kM = GroupedGemmType::MGroupedContiguous;
constexpr auto kK = GroupedGemmType::KGroupedContiguous;
using NT256 = Config<kM, Major::K, Major::K, 256, 4, 1, false>;
using NT256C2 = Config<kM, Major::K, Major::K, 256, 4, 2, false>;
using NT128 = Config<kM, Major::K, Major::K, 128, 6, 1, false>;
using NT128C2 = Config<kM, Major::K, Major::K, 128, 6, 2, false>;
using NT256P = Config<kM, Major::K, Major::K, 256, 4, 1, true>;
using NN256 = Config<kM, Major::K, Major::MN, 256, 4, 1, false>;
using NN256C2 = Config<kM, Major::K, Major::MN, 256, 4, 2, false>;
using NN128C2 = Config<kM, Major::K, Major::MN, 128, 6, 2, false>;
using KG256 = Config<kK, Major::MN, Major::MN, 256, 4, 1, false>;
using KG256C2 = Config<kK, Major::MN, Major::MN, 256, 4, 2, false>;

//                          name       kind      E   slots     M     N     K  empty zipf tail
constexpr Problem kFwdNT  {"fwd",     Kind::NT, 32,  24576,    0, 1536, 2048, 5, false, 192};
constexpr Problem kOddNT  {"odd",     Kind::NT, 24,  12000,    0, 1000, 1000, 4, false, 64};
constexpr Problem kSkewNT {"skew",    Kind::NT, 64,  32768,    0, 2048,  768, 0, true,  0};
constexpr Problem kDgrad  {"dgrad",   Kind::NN, 32,  24576,    0, 1024, 2048, 5, false, 192};
constexpr Problem kWgrad  {"wgrad",   Kind::KG, 32,  24576, 1536, 2048,    0, 5, false, 0};
// Qwen3-30B-A3B, T 16384, top-8: 131072 routed rows over 128 experts.
constexpr Problem kL1Fwd  {"L1_fwd",  Kind::NT, 128, 131072,   0, 1536, 2048, 0, false, 0};
constexpr Problem kL2Fwd  {"L2_fwd",  Kind::NT, 128, 131072,   0, 2048,  768, 0, false, 0};
constexpr Problem kL2Dgr  {"L2_dgrad",Kind::NN, 128, 131072,   0,  768, 2048, 0, false, 0};
constexpr Problem kL1Dgr  {"L1_dgrad",Kind::NN, 128, 131072,   0, 2048, 1536, 0, false, 0};
constexpr Problem kL1Wgr  {"L1_wgrad",Kind::KG, 128, 131072, 1536, 2048,    0, 0, false, 0};
constexpr Problem kL2Wgr  {"L2_wgrad",Kind::KG, 128, 131072, 2048,  768,    0, 0, false, 0};

struct Case {
    const Problem* problem;
    void (*run)(const Problem&, int, bool);
    bool perf;
};

static const Case kCases[] = {
    {&kFwdNT, run_case<NT256>, false},  {&kFwdNT, run_case<NT256C2>, false}, {&kFwdNT, run_case<NT128>, false},
    {&kFwdNT, run_case<NT256P>, false}, {&kOddNT, run_case<NT128>, false},   {&kOddNT, run_case<NT256>, false},
    {&kSkewNT, run_case<NT256>, false}, {&kDgrad, run_case<NN256>, false},   {&kDgrad, run_case<NN256C2>, false},
    {&kWgrad, run_case<KG256>, false},  {&kWgrad, run_case<KG256C2>, false},
    {&kL1Fwd, run_case<NT256>, true},   {&kL1Fwd, run_case<NT256C2>, true},  {&kL1Fwd, run_case<NT128>, true},
    {&kL1Fwd, run_case<NT256P>, true},  {&kL2Fwd, run_case<NT256>, true},    {&kL2Fwd, run_case<NT256C2>, true},
    {&kL2Dgr, run_case<NN256>, true},   {&kL2Dgr, run_case<NN128C2>, true},  {&kL1Dgr, run_case<NN256>, true},
    {&kL1Dgr, run_case<NN256C2>, true}, {&kL1Wgr, run_case<KG256>, true},    {&kL1Wgr, run_case<KG256C2>, true},
    {&kL2Wgr, run_case<KG256>, true},   {&kL1Fwd, run_case<NT128C2>, true},
};
constexpr int kNumCases = sizeof(kCases) / sizeof(kCases[0]);

int main(int argc, char** argv) {
    if (argc != 2) {
        std::fprintf(stderr, "usage: %s list | <case 0..%d>\n", argv[0], kNumCases - 1);
        return 2;
    }
    if (std::strcmp(argv[1], "list") == 0) {
        for (int i = 0; i < kNumCases; ++i)
            std::printf("%d %s %s\n", i, kCases[i].problem->name, kCases[i].perf ? "perf" : "check");
        return 0;
    }
    const int idx = std::atoi(argv[1]);
    if (idx < 0 || idx >= kNumCases) {
        std::fprintf(stderr, "case %d out of range [0, %d)\n", idx, kNumCases);
        return 2;
    }
    const Case& c = kCases[idx];
    c.run(*c.problem, 20, c.perf);
    return 0;
}
