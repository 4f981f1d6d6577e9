#pragma once
// Warpgroup MMA (wgmma, sm_90a).
//
// Inline asm cannot take a parameter pack, so the accumulator operand lists ("%0, %1, ...", and
// "+f"(d[0]), ...) and the operand numbers after them are generated here by the preprocessor from
// the decimal digits of the register count R = 10 T + U (T, U single tokens; T empty below 10), for
// every R that is a multiple of 4 up to 128: an m64nNk16 (bf16) or m64nNk32 (e4m3) shape with fp32
// accumulators has R = N / 2. A new shape is one DGE_DEFINE_* line.

#include <cstdint>

namespace dge::ptx {

// Orders register and smem accesses of the warpgroup before the next wgmma.mma_async.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit_group() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Wait until at most N committed wgmma groups of this warpgroup are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
}

// Pins an accumulator register at this point so the compiler neither reads it while a wgmma may
// still write it nor moves the read across the wait.
__device__ __forceinline__ void fence_operand(float& reg) {
    asm volatile("" : "+f"(reg) :: "memory");
}

}  // namespace dge::ptx

// -- operand-list generator ------------------------------------------------------------------------

#define DGE_PP_CAT_(a, b) a##b
#define DGE_PP_CAT(a, b) DGE_PP_CAT_(a, b)
#define DGE_PP_STR_(x) #x
#define DGE_PP_STR(x) DGE_PP_STR_(x)
#define DGE_PP_COMMA() ,
#define DGE_PP_STR_COMMA() ", "

// Item (t, 0), preceded by the separator S() unless it is the very first item (t empty).
#define DGE_PP_FIRST_(I, S) I(, 0)
#define DGE_PP_FIRST_1(I, S) S() I(1, 0)
#define DGE_PP_FIRST_2(I, S) S() I(2, 0)
#define DGE_PP_FIRST_3(I, S) S() I(3, 0)
#define DGE_PP_FIRST_4(I, S) S() I(4, 0)
#define DGE_PP_FIRST_5(I, S) S() I(5, 0)
#define DGE_PP_FIRST_6(I, S) S() I(6, 0)
#define DGE_PP_FIRST_7(I, S) S() I(7, 0)
#define DGE_PP_FIRST_8(I, S) S() I(8, 0)
#define DGE_PP_FIRST_9(I, S) S() I(9, 0)
#define DGE_PP_FIRST_10(I, S) S() I(10, 0)
#define DGE_PP_FIRST_11(I, S) S() I(11, 0)
#define DGE_PP_FIRST_12(I, S) S() I(12, 0)
// Items (t, 0) .. (t, 9), and the first 10 T items.
#define DGE_PP_FIRST(t) DGE_PP_FIRST_X(t)
#define DGE_PP_FIRST_X(t) DGE_PP_FIRST_##t
#define DGE_PP_ROW(I, S, t) DGE_PP_FIRST(t)(I, S) S() I(t, 1) S() I(t, 2) S() I(t, 3) S() I(t, 4) \
    S() I(t, 5) S() I(t, 6) S() I(t, 7) S() I(t, 8) S() I(t, 9)
#define DGE_PP_ROWS_(I, S)
#define DGE_PP_ROWS_1(I, S) DGE_PP_ROW(I, S, )
#define DGE_PP_ROWS_2(I, S) DGE_PP_ROWS_1(I, S) DGE_PP_ROW(I, S, 1)
#define DGE_PP_ROWS_3(I, S) DGE_PP_ROWS_2(I, S) DGE_PP_ROW(I, S, 2)
#define DGE_PP_ROWS_4(I, S) DGE_PP_ROWS_3(I, S) DGE_PP_ROW(I, S, 3)
#define DGE_PP_ROWS_5(I, S) DGE_PP_ROWS_4(I, S) DGE_PP_ROW(I, S, 4)
#define DGE_PP_ROWS_6(I, S) DGE_PP_ROWS_5(I, S) DGE_PP_ROW(I, S, 5)
#define DGE_PP_ROWS_7(I, S) DGE_PP_ROWS_6(I, S) DGE_PP_ROW(I, S, 6)
#define DGE_PP_ROWS_8(I, S) DGE_PP_ROWS_7(I, S) DGE_PP_ROW(I, S, 7)
#define DGE_PP_ROWS_9(I, S) DGE_PP_ROWS_8(I, S) DGE_PP_ROW(I, S, 8)
#define DGE_PP_ROWS_10(I, S) DGE_PP_ROWS_9(I, S) DGE_PP_ROW(I, S, 9)
#define DGE_PP_ROWS_11(I, S) DGE_PP_ROWS_10(I, S) DGE_PP_ROW(I, S, 10)
#define DGE_PP_ROWS_12(I, S) DGE_PP_ROWS_11(I, S) DGE_PP_ROW(I, S, 11)
// Items (t, 0) .. (t, U - 1) for even U.
#define DGE_PP_PART_0(I, S, t)
#define DGE_PP_PART_2(I, S, t) DGE_PP_FIRST(t)(I, S) S() I(t, 1)
#define DGE_PP_PART_4(I, S, t) DGE_PP_PART_2(I, S, t) S() I(t, 2) S() I(t, 3)
#define DGE_PP_PART_6(I, S, t) DGE_PP_PART_4(I, S, t) S() I(t, 4) S() I(t, 5)
#define DGE_PP_PART_8(I, S, t) DGE_PP_PART_6(I, S, t) S() I(t, 6) S() I(t, 7)
// Items 0 .. 10 T + U - 1 (item (t, u) is number 10 t + u), separated by S().
// (Each dispatch pastes with its own macro: a macro is not expanded again inside its own expansion.)
#define DGE_PP_ROWS(T) DGE_PP_ROWS_X(T)
#define DGE_PP_ROWS_X(T) DGE_PP_ROWS_##T
#define DGE_PP_PART(U) DGE_PP_PART_X(U)
#define DGE_PP_PART_X(U) DGE_PP_PART_##U
#define DGE_PP_LIST(I, S, T, U) DGE_PP_ROWS(T)(I, S) DGE_PP_PART(U)(I, S, T)

// Tens token + 1, and the five operand numbers R .. R + 4 after R = 10 T + U accumulators, passed
// to F after the arguments X and L.
#define DGE_PP_INC(t) DGE_PP_INC_X(t)
#define DGE_PP_INC_X(t) DGE_PP_INC_##t
#define DGE_PP_INC_ 1
#define DGE_PP_INC_1 2
#define DGE_PP_INC_2 3
#define DGE_PP_INC_3 4
#define DGE_PP_INC_4 5
#define DGE_PP_INC_5 6
#define DGE_PP_INC_6 7
#define DGE_PP_INC_7 8
#define DGE_PP_INC_8 9
#define DGE_PP_INC_9 10
#define DGE_PP_INC_10 11
#define DGE_PP_INC_11 12
#define DGE_PP_INC_12 13
#define DGE_ASM_OPERAND(t, u) "%" DGE_PP_STR(DGE_PP_CAT(t, u))
#define DGE_PP_TAIL_0(F, X, L, t, t1) F(X, L, DGE_ASM_OPERAND(t, 0), DGE_ASM_OPERAND(t, 1), DGE_ASM_OPERAND(t, 2), \
                                        DGE_ASM_OPERAND(t, 3), DGE_ASM_OPERAND(t, 4))
#define DGE_PP_TAIL_2(F, X, L, t, t1) F(X, L, DGE_ASM_OPERAND(t, 2), DGE_ASM_OPERAND(t, 3), DGE_ASM_OPERAND(t, 4), \
                                        DGE_ASM_OPERAND(t, 5), DGE_ASM_OPERAND(t, 6))
#define DGE_PP_TAIL_4(F, X, L, t, t1) F(X, L, DGE_ASM_OPERAND(t, 4), DGE_ASM_OPERAND(t, 5), DGE_ASM_OPERAND(t, 6), \
                                        DGE_ASM_OPERAND(t, 7), DGE_ASM_OPERAND(t, 8))
#define DGE_PP_TAIL_6(F, X, L, t, t1) F(X, L, DGE_ASM_OPERAND(t, 6), DGE_ASM_OPERAND(t, 7), DGE_ASM_OPERAND(t, 8), \
                                        DGE_ASM_OPERAND(t, 9), DGE_ASM_OPERAND(t1, 0))
#define DGE_PP_TAIL_8(F, X, L, t, t1) F(X, L, DGE_ASM_OPERAND(t, 8), DGE_ASM_OPERAND(t, 9), DGE_ASM_OPERAND(t1, 0), \
                                        DGE_ASM_OPERAND(t1, 1), DGE_ASM_OPERAND(t1, 2))
#define DGE_PP_TAIL_X(U) DGE_PP_TAIL_##U
#define DGE_PP_TAIL(F, X, T, U) \
    DGE_PP_TAIL_X(U)(F, X, DGE_PP_LIST(DGE_ASM_OPERAND, DGE_PP_STR_COMMA, T, U), T, DGE_PP_INC(T))

// "+f"(d[10 t + u]): the read-write accumulator operands.
#define DGE_WGMMA_ACC(t, u) "+f"(d[DGE_PP_CAT(t, u)])

// -- instructions ------------------------------------------------------------------------------------

namespace dge::ptx {

// D[64 x N] (+)= A[64 x 16] * B[16 x N], fp32 accumulators, bf16 operands from smem descriptors;
// kTransA / kTransB select MN-major operands. Defined for the N listed below.
template <uint32_t N, uint32_t kTransA, uint32_t kTransB>
struct WgmmaBF16SS;

// Operands: accumulators, desc_a, desc_b, scale_d (D is overwritten when 0), then the two transpose
// immediates.
#define DGE_WGMMA_BF16_SS_TEXT(N, L, a, b, s, ta, tb)                                          \
    "{\n.reg .pred p;\nsetp.ne.b32 p, " s ", 0;\n"                                              \
    "wgmma.mma_async.sync.aligned.m64n" DGE_PP_STR(N) "k16.f32.bf16.bf16 {" L "}, " a ", " b \
    ", p, 1, 1, " ta ", " tb ";\n}\n"
// N with R = N / 2 = 10 T + U accumulators per thread.
#define DGE_DEFINE_WGMMA_BF16_SS(N, T, U)                                                                    \
    template <uint32_t kTransA, uint32_t kTransB>                                                            \
    struct WgmmaBF16SS<N, kTransA, kTransB> {                                                                \
        static_assert(10 * (T + 0) + U == N / 2, "DGE_DEFINE_WGMMA_BF16_SS: T, U must be the digits of N/2"); \
        __device__ __forceinline__ static void mma(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,      \
                                                   uint32_t scale_d) {                                       \
            asm volatile(DGE_PP_TAIL(DGE_WGMMA_BF16_SS_TEXT, N, T, U)                                        \
                         : DGE_PP_LIST(DGE_WGMMA_ACC, DGE_PP_COMMA, T, U)                                    \
                         : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransA), "n"(kTransB));              \
        }                                                                                                    \
    };

DGE_DEFINE_WGMMA_BF16_SS(128, 6, 4)
DGE_DEFINE_WGMMA_BF16_SS(256, 12, 8)

// D[64 x N] (+)= A[64 x 32] * B[32 x N], fp32 accumulators, e4m3 operands from smem descriptors. fp8
// wgmma has no transpose immediates: both operands must be K-major. Defined for the N listed below.
template <uint32_t N>
struct WgmmaE4M3SS;

// Operands: accumulators, desc_a, desc_b, scale_d (D is overwritten when 0); the two trailing
// arguments of the generator (ta, tb) are unused.
#define DGE_WGMMA_E4M3_SS_TEXT(N, L, a, b, s, ta, tb)                                          \
    "{\n.reg .pred p;\nsetp.ne.b32 p, " s ", 0;\n"                                              \
    "wgmma.mma_async.sync.aligned.m64n" DGE_PP_STR(N) "k32.f32.e4m3.e4m3 {" L "}, " a ", " b \
    ", p, 1, 1;\n}\n"
#define DGE_DEFINE_WGMMA_E4M3_SS(N, T, U)                                                                    \
    template <>                                                                                              \
    struct WgmmaE4M3SS<N> {                                                                                  \
        static_assert(10 * (T + 0) + U == N / 2, "DGE_DEFINE_WGMMA_E4M3_SS: T, U must be the digits of N/2"); \
        __device__ __forceinline__ static void mma(float (&d)[N / 2], uint64_t desc_a, uint64_t desc_b,      \
                                                   uint32_t scale_d) {                                       \
            asm volatile(DGE_PP_TAIL(DGE_WGMMA_E4M3_SS_TEXT, N, T, U)                                        \
                         : DGE_PP_LIST(DGE_WGMMA_ACC, DGE_PP_COMMA, T, U)                                    \
                         : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                          \
        }                                                                                                    \
    };

DGE_DEFINE_WGMMA_E4M3_SS(128, 6, 4)
DGE_DEFINE_WGMMA_E4M3_SS(192, 9, 6)
DGE_DEFINE_WGMMA_E4M3_SS(256, 12, 8)

}  // namespace dge::ptx
