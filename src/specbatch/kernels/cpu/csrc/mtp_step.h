// The MTP head's draft step as one op: x = eh_proj([enorm(emb); hnorm(h)]), one llama block
// whose queries attend over the target's last-layer keys (read in place, never copied) and
// then the head's own keys of this round, and the final norm. The functions the separate ops
// run (norms, the block walk, qkv_rope, attention, mlp_block), in their order, so the same
// bits; in the engine the step was ~12 ops, a context concatenation among them, each paying
// its dispatch while the head's weights come back from memory after every verify.
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "projections.h"

namespace specbatch {

namespace mx = mlx::core;

// The block's shape and each norm's eps: the input norm's is qkv.eps.
struct MtpShape {
  QkvShape qkv;
  float attn_scale;
  float eps_emb, eps_hidden, eps_post, eps_out;
};

// The head's arrays in this order (evaluated first where they are not).
enum MtpWeight { kEnorm, kHnorm, kEhProj, kNormIn, kWq, kWk, kWv, kNormPost, kWg, kWu, kWd, kWo, kNormOut, kMtpWeights };

// h, emb [B, K]; positions int32 [B] (the query positions); ctx_k, ctx_v [B or 1, Hkv, C, D]
// (any strides: a cache buffer read in place, D strided copied), of which the first `length` keys are
// attended, masked by ctx_mask bool [B or 1, length] where given. Paged (ctx_slots int32 [B or 1,
// length]): ctx_k, ctx_v are a paged layer's pools [Hkv, P, D], keys in 16-slot blocks
// (paged_write.h), and row b's context key j is slot ctx_slots[b, j]; own_k, own_v: the head's
// keys and values of this round's earlier steps, each [B, Hkv, 1, D] -> {hidden [B, K], k and
// v [B, Hkv, 1, D] (this step's, k roped)}.
std::vector<mx::array> mtp_step(const mx::array& h, const mx::array& emb, const mx::array& positions,
                                const mx::array& inv_freq, const mx::array& ctx_k, const mx::array& ctx_v, int length,
                                const std::optional<mx::array>& ctx_mask, const std::optional<mx::array>& ctx_slots,
                                const std::vector<mx::array>& own_k, const std::vector<mx::array>& own_v,
                                const std::vector<mx::array>& weights, const MtpShape& shape);

class MtpStep : public mx::Primitive {
 public:
  MtpStep(mx::Stream stream, MtpShape shape, std::vector<mx::array> weights, int length, int own, bool masked,
          bool paged)
      : mx::Primitive(stream), shape_(shape), weights_(std::move(weights)), length_(length), own_(own),
        masked_(masked), paged_(paged) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "SpecbatchMtpStep"; }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  void run(const std::vector<mx::array>& in, float* hidden, float* k, float* v) const;
  void attend(const std::vector<mx::array>& in, int D, const float* q, const float* k, const float* v,
              float* heads) const;
  MtpShape shape_;
  std::vector<mx::array> weights_;  // evaluated constants, as the decoder stack holds its own
  int length_, own_;  // context keys attended; the head's own earlier keys (inputs after the mask)
  bool masked_, paged_;  // inputs: h, emb, positions, inv_freq, ctx_k, ctx_v, [slots], [mask], own keys, own values
};

}  // namespace specbatch
