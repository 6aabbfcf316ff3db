/*
 * moezoo's native CPU kernels for SwiGLU experts when each expert sees only a few tokens (decoding, short
 * sequences), fp32, weights in transformers' layout: gate_up (E, 2I, H) with gate rows first, down (E, H, I).
 *
 * With ~8 tokens per expert every expert's weights are read once and used 8 times, so the work is bound by
 * streaming the weights from memory. BLAS packs each weight matrix before such a skinny product, which reads it
 * twice; these kernels read every weight once per chunk of an expert's pairs, in order, with the few token rows
 * resident in L1:
 *   - products with W (forward): 4 weight rows x 4 tokens accumulate in 16 vector registers along the contiguous
 *     input dimension, then one shuffle tree reduces all 16 dot products at once;
 *   - products with W^T (input gradients): W read row after row, two rows at a time, into 8 output rows in L1;
 *   - weight gradients: every row written once, as the sum over the chunk's tokens of coefficient x row.
 * An expert's pairs go in chunks (16 in the forward, 8 in the backward pass, where they are padded with zero rows);
 * experts run in parallel (OpenMP).
 * With many tokens per expert BLAS does the products, and moezoo_swiglu_pairs(_backward) near the end of this file
 * do the SwiGLU of all pairs (and its derivative) in one pass each. moezoo_sort_pairs groups a call's pairs by expert
 * for these kernels. Last, moezoo_read_floats: the plain streaming read that the benchmark sets beside these kernels
 * as the fastest any of them could read its weights.
 *
 * Compiled on first use by moezoo/kernels/native.py for this CPU (-march=native; its BASE_FLAGS). Written with
 * GCC/Clang vector extensions rather than intrinsics (streaming stores aside), so it also builds for CPUs without
 * AVX-512; it is tuned and tested on AVX-512 only.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16
#define FORWARD_CHUNK 16        /* pairs per pass over an expert's weights in the forward pass, in groups of 4 */
#define CHUNK 8                 /* pairs per pass in the backward pass: 2 x 8 coefficients held in registers */
#define PREFETCH_FLOATS 2048    /* how far ahead of a row-by-row weight stream to prefetch (8 KiB, measured) */

typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float vec_unaligned __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
typedef int32_t int_vec __attribute__((vector_size(LANES * sizeof(int32_t))));  /* lane masks, shuffle indices */

static inline vec load(const float *p) { return *(const vec_unaligned *)p; }
static inline void store(float *p, vec v) { *(vec_unaligned *)p = v; }

/* A store that bypasses the cache (no read of the old line first); p must be 64-byte aligned. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline void store_streaming(float *p, vec v) { _mm512_stream_ps(p, (__m512)v); }
static inline void streaming_done(void) { _mm_sfence(); }
#else
static inline void store_streaming(float *p, vec v) { store(p, v); }
static inline void streaming_done(void) {}
#endif

/* Lanes [lo | hi] of a and b folded in half and concatenated: one level of a 16-way horizontal sum. */
static inline vec fold(vec a, vec b, int_vec first, int_vec second) {
    return __builtin_shuffle(a, b, first) + __builtin_shuffle(a, b, second);
}

/* Lane j of the result is the sum of the 16 lanes of acc[j]. */
static inline vec sum_each(const vec acc[16]) {
    const int_vec h1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const int_vec h2 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const int_vec q1 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const int_vec q2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const int_vec e1 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const int_vec e2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const int_vec s1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const int_vec s2 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    vec halves[8], quarters[4], eighths[2];
    for (int j = 0; j < 8; j++) halves[j] = fold(acc[2 * j], acc[2 * j + 1], h1, h2);
    for (int j = 0; j < 4; j++) quarters[j] = fold(halves[2 * j], halves[2 * j + 1], q1, q2);
    for (int j = 0; j < 2; j++) eighths[j] = fold(quarters[2 * j], quarters[2 * j + 1], e1, e2);
    return fold(eighths[0], eighths[1], s1, s2);
}

/* acc[row * 4 + t] += sum_k w_rows[row, k] * x[t, k] for 4 weight rows and `tokens` (1-4, a constant after
 * inlining) rows of x; while at it, prefetches the rows `prefetch_rows` (bit r: row r) of the block of 4 rows two
 * blocks ahead, spread over the loop (a burst of prefetches would stall the loads), into L2. */
static inline __attribute__((always_inline)) void four_rows_times_tokens(const float *restrict w_rows, int64_t depth,
                                                                         const float *restrict x, const int tokens,
                                                                         int prefetch_rows, vec acc[16]) {
    for (int64_t k = 0; k < depth; k += LANES) {
        vec xs[4];
        for (int t = 0; t < tokens; t++) xs[t] = load(x + t * depth + k);
        for (int row = 0; row < 4; row++)
            if (prefetch_rows & (1 << row)) __builtin_prefetch(w_rows + 8 * depth + row * depth + k, 0, 1);
        for (int row = 0; row < 4; row++) {
            vec a = load(w_rows + row * depth + k);
            for (int t = 0; t < tokens; t++) acc[row * 4 + t] += a * xs[t];
        }
    }
}

/* out[t, r] = sum_k w[r, k] * x[t, k] for the first n rows of x; w is (rows, depth), rows % 4 == 0, depth % 16 == 0.
 * Four weight rows at a time against four tokens at a time (16 accumulators, 8 loads per 16 FMAs), and the last
 * 1-3 tokens without padding. The passes over a block share its prefetches, so that requests to memory keep going
 * out while the block is reused from L1. */
static void times_weight_transposed(const float *restrict w, int64_t rows, int64_t depth, const float *restrict x,
                                    int64_t n, float *restrict out) {
    int64_t passes = (n + 3) / 4;
    for (int64_t r = 0; r < rows; r += 4) {
        const float *w_rows = w + r * depth;
        for (int64_t t0 = 0; t0 < n; t0 += 4) {
            vec acc[16] = {0};
            int prefetch = 0;
            for (int row = 0; row < 4; row++)
                if (row % passes == t0 / 4) prefetch |= 1 << row;
            switch (n - t0) {
                case 1: four_rows_times_tokens(w_rows, depth, x + t0 * depth, 1, prefetch, acc); break;
                case 2: four_rows_times_tokens(w_rows, depth, x + t0 * depth, 2, prefetch, acc); break;
                case 3: four_rows_times_tokens(w_rows, depth, x + t0 * depth, 3, prefetch, acc); break;
                default: four_rows_times_tokens(w_rows, depth, x + t0 * depth, 4, prefetch, acc);
            }
            float sums[LANES];
            store(sums, sum_each(acc));
            for (int row = 0; row < 4; row++)
                for (int t = 0; t < 4 && t0 + t < n; t++) out[(t0 + t) * rows + r + row] = sums[row * 4 + t];
        }
    }
}

/* out[t, c] = sum_k coef[t, k] * w[k, c] for the CHUNK rows of coef; w is (depth, cols), depth % 2 == 0,
 * cols % 16 == 0. W is read row after row (one sequential stream); the CHUNK output rows stay in L1. */
static void times_weight(const float *restrict w, int64_t depth, int64_t cols, const float *restrict coef,
                         float *restrict out) {
    memset(out, 0, sizeof(float) * CHUNK * cols);
    for (int64_t k = 0; k < depth; k += 2) {
        const float *w0 = w + k * cols, *w1 = w0 + cols;
        float c0[CHUNK], c1[CHUNK];
        for (int t = 0; t < CHUNK; t++) {
            c0[t] = coef[t * depth + k];
            c1[t] = coef[t * depth + k + 1];
        }
        for (int64_t c = 0; c < cols; c += LANES) {
            __builtin_prefetch(w0 + c + PREFETCH_FLOATS, 0, 1);
            __builtin_prefetch(w1 + c + PREFETCH_FLOATS, 0, 1);
            vec a = load(w0 + c), b = load(w1 + c);
            for (int t = 0; t < CHUNK; t++) store(out + t * cols + c, load(out + t * cols + c) + c0[t] * a + c1[t] * b);
        }
    }
}

/* grad[r, :] = sum_{t<n} coef[t, r] * x[t, :]; coef is (n, rows), x is (n, cols), cols % 64 == 0.
 * Every row is written once and not read again here, so a 64-byte aligned `grad` is written with streaming stores,
 * which skip reading the old contents into the cache (half the memory traffic of ordinary stores). */
static void outer_product(const float *restrict coef, int64_t rows, const float *restrict x, int64_t n, int64_t cols,
                          float *restrict grad) {
    int streaming = (uintptr_t)grad % 64 == 0;
    for (int64_t r = 0; r < rows; r++) {
        float *grad_row = grad + r * cols;
        for (int64_t c = 0; c < cols; c += 4 * LANES) {
            vec acc[4] = {0};
            for (int64_t t = 0; t < n; t++) {
                const float *x_row = x + t * cols + c;
                float s = coef[t * rows + r];
                for (int j = 0; j < 4; j++) acc[j] += s * load(x_row + j * LANES);
            }
            for (int j = 0; j < 4; j++) {
                if (streaming) store_streaming(grad_row + c + j * LANES, acc[j]);
                else store(grad_row + c + j * LANES, acc[j]);
            }
        }
    }
}

static inline vec select_lanes(int_vec mask, vec if_true, vec if_false) {
    return (vec)(((int_vec)if_true & mask) | ((int_vec)if_false & ~mask));
}

/* exp on 16 lanes (expf called per lane costs as much as a tenth of the forward pass): x = n ln2 + r with
 * |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial (about 1 ulp), 2^n built in the exponent bits. Inputs are
 * clamped to [-87, 88], where 2^n stays a normal float; NaN stays NaN. */
static inline vec exp_lanes(vec x) {
    const vec high = (vec){0} + 88.0f, low = (vec){0} - 87.0f, rounding = (vec){0} + 12582912.0f;  /* 1.5 * 2^23 */
    x = select_lanes(x > high, high, select_lanes(x < low, low, x));
    vec n = (x * 1.44269504088896341f + rounding) - rounding;  /* round to nearest */
    vec r = x - n * 0.693359375f - n * -2.12194440e-4f;
    vec p = (vec){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vec)((__builtin_convertvector(n, int_vec) + 127) << 23);
}

static inline vec sigmoid_lanes(vec x) { return 1.0f / (1.0f + exp_lanes(-x)); }

/* One pair's weighted activation: act = silu(gate) * up * weight over `width` (a multiple of 16) lanes. */
static inline void swiglu_row(const float *restrict gate, const float *restrict up, float weight, int64_t width,
                              float *restrict act) {
    for (int64_t i = 0; i < width; i += LANES) {
        vec g = load(gate + i);
        store(act + i, g * sigmoid_lanes(g) * load(up + i) * weight);
    }
}

/* Backward of swiglu_row for one pair, from d_act = dL/d(act): writes dL/d(gate), dL/d(up) and, unless act is
 * NULL, the weighted activation again (for the down projection's weight gradient); returns dL/d(weight) =
 * d_act . (silu(gate) * up), summed in 16 lanes, then in double. */
static inline float swiglu_row_backward(const float *restrict gate, const float *restrict up,
                                        const float *restrict d_act, float weight, int64_t width,
                                        float *restrict act, float *restrict d_gate, float *restrict d_up) {
    vec weight_grad = {0};
    for (int64_t i = 0; i < width; i += LANES) {
        vec g = load(gate + i), u = load(up + i), d = load(d_act + i);
        vec s = sigmoid_lanes(g), silu = g * s, a = silu * u;
        weight_grad += d * a;
        if (act) store(act + i, a * weight);
        d *= weight;
        store(d_up + i, d * silu);
        store(d_gate + i, d * u * s * (1.0f + g * (1.0f - s)));
    }
    double total = 0.0;
    for (int lane = 0; lane < LANES; lane++) total += weight_grad[lane];
    return (float)total;
}

/* The input rows of pairs order[0..n) (pair slot = token * top_k + k) into the first `rows` rows of out, rows n..
 * zero. */
static void gather_rows(const float *restrict src, const int64_t *restrict order, int64_t top_k, int64_t n,
                        int64_t rows, int64_t width, float *restrict out) {
    for (int64_t t = 0; t < rows; t++) {
        if (t < n) memcpy(out + t * width, src + order[t] / top_k * width, sizeof(float) * width);
        else memset(out + t * width, 0, sizeof(float) * width);
    }
}

/* out[token] = sum over its top_k slots of pair_rows[position[slot]]: each token's k expert outputs, summed in slot
 * order (deterministic); width % 16 == 0. The k rows are read side by side, 16 floats of each at a time: k streams
 * keep more reads in flight than one row after the other (2% of a 64-token forward). Called inside a parallel
 * region; tokens are shared among its threads. */
static void sum_over_slots(const float *restrict pair_rows, const int64_t *restrict position, int64_t num_tokens,
                           int64_t top_k, int64_t width, float *restrict out) {
    #pragma omp for schedule(static)
    for (int64_t token = 0; token < num_tokens; token++) {
        const int64_t *slots = position + token * top_k;
        for (int64_t c = 0; c < width; c += LANES) {
            vec sum = load(pair_rows + slots[0] * width + c);
            for (int64_t k = 1; k < top_k; k++) sum += load(pair_rows + slots[k] * width + c);
            store(out + token * width + c, sum);
        }
    }
}

/*
 * The (token, slot) pairs grouped by expert, stably (a counting sort): order[offsets[e] .. offsets[e+1]) lists in
 * increasing order the slots p (= token * top_k + k) routed to expert e, expert_index[p] == e. One pass in C instead
 * of PyTorch's bincount, argsort and cumsum, each of which costs as much as the rest of a short call's bookkeeping.
 * Returns the number of experts that have pairs, or -1 (order and offsets unspecified) when an index lies outside
 * [0, num_experts).
 */
int64_t moezoo_sort_pairs(const int64_t *expert_index, int64_t num_pairs, int64_t num_experts, int64_t *order,
                          int64_t *offsets) {
    memset(offsets, 0, sizeof(int64_t) * (num_experts + 1));
    for (int64_t p = 0; p < num_pairs; p++) {
        if (expert_index[p] < 0 || expert_index[p] >= num_experts) return -1;
        offsets[expert_index[p] + 1]++;
    }
    int64_t hit = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        hit += offsets[e + 1] > 0;
        offsets[e + 1] += offsets[e];
    }
    int64_t *next = malloc(sizeof(int64_t) * (num_experts > 0 ? num_experts : 1));  /* each expert's next place */
    memcpy(next, offsets, sizeof(int64_t) * num_experts);
    for (int64_t p = 0; p < num_pairs; p++) order[next[expert_index[p]]++] = p;
    free(next);
    return hit;
}

/* position[slot] = the place of `slot` in the sorted order. */
static int64_t *positions(const int64_t *order, int64_t num_pairs) {
    int64_t *position = malloc(sizeof(int64_t) * (num_pairs > 0 ? num_pairs : 1));
    for (int64_t p = 0; p < num_pairs; p++) position[order[p]] = p;
    return position;
}

static float *scratch(int64_t floats) { return aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64); }

/*
 * Forward over the S = T * top_k (token, slot) pairs. `order` lists the slots (token * top_k + k) sorted by expert;
 * expert e owns order[offsets[e] .. offsets[e+1]); routing_weights is (T, top_k).
 *   projected[p] = W_gate_up[e] x[token]                                       (S, 2I), kept for the backward pass
 *   pair_out[p]  = W_down[e] (silu(gate) * up * routing weight)                (S, H), scratch
 *   out[token]   = sum of its top_k pair_out rows                              (T, H)
 */
void moezoo_swiglu_forward(const float *x, int64_t num_tokens, int64_t hidden, int64_t width, int64_t num_experts,
                           int64_t top_k, const int64_t *order, const int64_t *offsets, const float *routing_weights,
                           const float *gate_up, const float *down, float *projected, float *pair_out, float *out,
                           int num_threads) {
    int64_t *position = positions(order, num_tokens * top_k);
    #pragma omp parallel num_threads(num_threads)
    {
        float *xs = scratch(FORWARD_CHUNK * hidden), *act = scratch(FORWARD_CHUNK * width);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < num_experts; e++) {
            const float *w_up = gate_up + e * 2 * width * hidden, *w_down = down + e * hidden * width;
            for (int64_t p0 = offsets[e]; p0 < offsets[e + 1]; p0 += FORWARD_CHUNK) {
                int64_t n = offsets[e + 1] - p0 < FORWARD_CHUNK ? offsets[e + 1] - p0 : FORWARD_CHUNK;
                float *h = projected + p0 * 2 * width;
                gather_rows(x, order + p0, top_k, n, n, hidden, xs);
                times_weight_transposed(w_up, 2 * width, hidden, xs, n, h);
                for (int64_t t = 0; t < n; t++) {
                    const float *gate = h + t * 2 * width;
                    swiglu_row(gate, gate + width, routing_weights[order[p0 + t]], width, act + t * width);
                }
                times_weight_transposed(w_down, hidden, width, act, n, pair_out + p0 * hidden);
            }
        }
        sum_over_slots(pair_out, position, num_tokens, top_k, hidden, out);
        free(xs); free(act);
    }
    free(position);
}

/*
 * Backward of moezoo_swiglu_forward. Any output pointer may be NULL when that gradient is not needed:
 *   grad_x (T, H), which needs grad_pair_x (S, H) as scratch; grad_routing_weights (T, top_k);
 *   grad_gate_up (E, 2I, H), grad_down (E, H, I). Experts without pairs get zero weight gradients.
 */
void moezoo_swiglu_backward(const float *grad_out, const float *x, int64_t num_tokens, int64_t hidden, int64_t width,
                            int64_t num_experts, int64_t top_k, const int64_t *order, const int64_t *offsets,
                            const float *routing_weights, const float *gate_up, const float *down,
                            const float *projected, float *grad_pair_x, float *grad_x, float *grad_routing_weights,
                            float *grad_gate_up, float *grad_down, int num_threads) {
    int64_t most_pairs = 0;
    for (int64_t e = 0; e < num_experts; e++)
        if (offsets[e + 1] - offsets[e] > most_pairs) most_pairs = offsets[e + 1] - offsets[e];
    int64_t rows = (most_pairs + CHUNK - 1) / CHUNK * CHUNK;  /* an expert's pairs, padded to whole chunks */
    int64_t *position = positions(order, num_tokens * top_k);
    #pragma omp parallel num_threads(num_threads)
    {
        /* One expert's pairs at a time: its weight gradients are then written in one pass. */
        float *dy = scratch(rows * hidden), *xs = scratch(rows * hidden), *dx = scratch(CHUNK * hidden);
        float *d_act = scratch(CHUNK * width), *act = scratch(rows * width);
        float *d_projected = scratch(rows * 2 * width);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t e = 0; e < num_experts; e++) {
            const float *w_up = gate_up + e * 2 * width * hidden, *w_down = down + e * hidden * width;
            int64_t first = offsets[e], n = offsets[e + 1] - first;
            for (int64_t c0 = 0; c0 < n; c0 += CHUNK) {
                int64_t chunk = n - c0 < CHUNK ? n - c0 : CHUNK;
                float *dy_chunk = dy + c0 * hidden, *d_projected_chunk = d_projected + c0 * 2 * width;
                gather_rows(grad_out, order + first + c0, top_k, chunk, CHUNK, hidden, dy_chunk);
                times_weight(w_down, hidden, width, dy_chunk, d_act);   /* dL/d(weighted activation) */
                memset(d_projected_chunk, 0, sizeof(float) * CHUNK * 2 * width);
                for (int64_t t = 0; t < chunk; t++) {
                    int64_t p = first + c0 + t;
                    const float *gate = projected + p * 2 * width;
                    float *d_gate = d_projected_chunk + t * 2 * width;
                    float weight_grad = swiglu_row_backward(gate, gate + width, d_act + t * width,
                                                            routing_weights[order[p]], width, act + (c0 + t) * width,
                                                            d_gate, d_gate + width);
                    if (grad_routing_weights) grad_routing_weights[order[p]] = weight_grad;
                }
                if (grad_x) {
                    times_weight(w_up, 2 * width, hidden, d_projected_chunk, dx);
                    memcpy(grad_pair_x + (first + c0) * hidden, dx, sizeof(float) * chunk * hidden);
                }
                if (grad_gate_up)
                    gather_rows(x, order + first + c0, top_k, chunk, CHUNK, hidden, xs + c0 * hidden);
            }
            if (grad_down) outer_product(dy, hidden, act, n, width, grad_down + e * hidden * width);
            if (grad_gate_up) outer_product(d_projected, 2 * width, xs, n, hidden, grad_gate_up + e * 2 * width * hidden);
        }
        if (grad_x) sum_over_slots(grad_pair_x, position, num_tokens, top_k, hidden, grad_x);
        streaming_done();  /* order the streaming stores before anything that follows */
        free(dy); free(xs); free(dx); free(d_act); free(act); free(d_projected);
    }
    free(position);
}

/*
 * The SwiGLU of calls with many pairs per expert, where one BLAS GEMM per expert does the products: one parallel
 * pass over all S pairs (sorted by expert) between those GEMMs, instead of PyTorch's three (silu, x up, x weight)
 * forward and six backward.
 */

/* weighted_act[p] = silu(gate[p]) * up[p] * pair_weights[p], from projected = [gate | up]           (S, I) */
void moezoo_swiglu_pairs(const float *projected, int64_t num_pairs, int64_t width, const float *pair_weights,
                         float *weighted_act, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_pairs; p++) {
        const float *gate = projected + p * 2 * width;
        swiglu_row(gate, gate + width, pair_weights[p], width, weighted_act + p * width);
    }
}

/* Backward of moezoo_swiglu_pairs from d_weighted_act (S, I): d_projected (S, 2I) and, unless NULL, weighted_act
 * again (S, I) and grad_pair_weights (S). */
void moezoo_swiglu_pairs_backward(const float *projected, const float *d_weighted_act, int64_t num_pairs,
                                  int64_t width, const float *pair_weights, float *weighted_act, float *d_projected,
                                  float *grad_pair_weights, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t p = 0; p < num_pairs; p++) {
        const float *gate = projected + p * 2 * width;
        float *d_gate = d_projected + p * 2 * width;
        float weight_grad = swiglu_row_backward(gate, gate + width, d_weighted_act + p * width, pair_weights[p],
                                                width, weighted_act ? weighted_act + p * width : NULL, d_gate,
                                                d_gate + width);
        if (grad_pair_weights) grad_pair_weights[p] = weight_grad;
    }
}

/* The sum of n floats, read once from memory as fast as this CPU streams them (OpenMP over 16 KiB blocks, prefetching
 * ahead in each): the floor `moezoo bench moe-layer` sets beside the experts kernels, which cannot read their weights
 * any faster. */
void moezoo_read_floats(const float *p, int64_t n, float *total, int num_threads) {
    const int64_t block = 4096;
    double sum = 0.0;
    #pragma omp parallel for schedule(static) reduction(+:sum) num_threads(num_threads)
    for (int64_t b = 0; b < n / block; b++) {
        const float *q = p + b * block;
        vec acc[4] = {0};
        for (int64_t i = 0; i < block; i += 4 * LANES) {
            __builtin_prefetch(q + i + PREFETCH_FLOATS, 0, 1);
            for (int j = 0; j < 4; j++) acc[j] += load(q + i + j * LANES);
        }
        vec all = acc[0] + acc[1] + acc[2] + acc[3];
        for (int lane = 0; lane < LANES; lane++) sum += all[lane];
    }
    for (int64_t i = n / block * block; i < n; i++) sum += p[i];
    *total = (float)sum;
}
