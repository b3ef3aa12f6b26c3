// Merging partial attention results through their log-sum-exp: the step that joins the outputs
// of attention over disjoint sets of keys (ring attention's one output per K/V shard) into the
// output over all of them. The Rust layer has validated every argument (shapes, strides, dtype,
// buffer sizes) before these run.
//
// A partial result over keys K_i is (O_i, L_i) with L_i the natural log of the row's sum of
// exponentials of its logits over K_i and O_i the softmax-weighted mean of V over K_i. Over
// K_1 ∪ K_2 (disjoint): m = max(L_1, L_2), O = (e^(L_1-m) O_1 + e^(L_2-m) O_2) / (e^(L_1-m) +
// e^(L_2-m)), L = m + ln(e^(L_1-m) + e^(L_2-m)). A row that saw no key has L = -inf and adds
// nothing; a row no part saw keeps O = 0, L = -inf (what the attention kernels output for it).
#pragma once

#include <cstdint>

#include "sdpa/sdpa.h"

namespace sdpa {

// The running result of one shard of queries, f32: acc_o dense [rows][head_dim] with rows in
// (batch, head, seq) order, acc_lse [rows]. merge_init sets it to "no key seen" (0, -inf).
void merge_init(float* acc_o, float* acc_lse, int64_t rows, int64_t head_dim, void* stream);

// One partial result folded into the running one (MergeArgs, sdpa/args.h).
void merge_partial(const MergeArgs& a, void* stream);

// The running result rounded to the output dtype at the output's strides (MergeFinishArgs).
void merge_finish(const MergeFinishArgs& a, void* stream);

}  // namespace sdpa
